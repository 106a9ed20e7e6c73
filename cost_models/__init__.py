"""cost_models"""
