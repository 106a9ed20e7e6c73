"""What training feeds each model input: the graph's answer (``passes.inputs``), the user's pins
(``planner plan --input NAME=ROLE``), and the error when neither settles an input."""

from __future__ import annotations

from planner.frontend.frontend_errors import ModelError
from runtime.contract.data_roles import INPUT_ROLES

__all__ = ["parse_input_pins", "resolve_inputs", "INPUT_HELP"]

INPUT_HELP = (
    "Roles: tokens (token ids), labels (the same ids; the model shifts them itself, as HF's labels= "
    "does), targets (the next tokens), ones / zeros (a constant, e.g. an attention mask), positions "
    "(0..S-1 per row)."
)


def parse_input_pins(items: list[str] | None) -> dict[str, str]:
    """``["attention_mask=ones", ...]`` -> ``{"attention_mask": "ones"}``, with a clear error."""
    pins: dict[str, str] = {}
    for item in items or []:
        name, sep, role = item.partition("=")
        name, role = name.strip(), role.strip()
        if not sep or not name or not role:
            raise ModelError(f"--input {item!r}: expected NAME=ROLE, e.g. --input attention_mask=ones. {INPUT_HELP}")
        if role not in INPUT_ROLES:
            raise ModelError(f"--input {item!r}: unknown role {role!r}. {INPUT_HELP}")
        pins[name] = role
    return pins


def resolve_inputs(facts: list[dict] | None, pins: dict[str, str] | None, spec: str) -> list[dict]:
    """plan.json's ``model.inputs``: every input with its role (pins win over the graph) and the
    vocabulary token roles index. Raises ``ModelError`` for a pin naming no input, an input no
    rule explains, or a model with no token input to draw training data for."""
    facts = [dict(f) for f in facts or []]
    pins = dict(pins or {})
    names = [f["name"] for f in facts]
    unknown = sorted(set(pins) - set(names))
    if unknown:
        raise ModelError(
            f"--input names {', '.join(repr(name) for name in unknown)}, but the model {spec!r} takes "
            f"{', '.join(repr(n) for n in names) or 'no inputs'}."
        )
    for f in facts:
        if f["name"] in pins:
            f["role"], f["why"] = pins[f["name"]], "set by --input"
    for f in facts:
        if f["role"] is None:
            shape = "x".join(str(size) for size in f["shape"])
            raise ModelError(
                f"The model {spec!r} takes an input {f['name']!r} ({f['dtype']}, shape {shape}) whose meaning "
                f"the planner cannot infer: it neither indexes an embedding nor is the target of a loss, and its "
                f"name is not one the HF ecosystem uses for a mask or positions. Training has to feed it "
                f"something, so say what with --input {f['name']}=ROLE when planning. {INPUT_HELP}"
            )
        if f["role"] in ("tokens", "labels", "targets", "positions") and (
            len(f["shape"]) != 2 or f["dtype"] not in ("int64", "int32", "int16", "uint8", "int8")
        ):
            raise ModelError(
                f"The model {spec!r} input {f['name']!r} has role {f['role']} but is "
                f"{f['dtype']} of shape {f['shape']}; token ids, labels, targets and positions "
                "are integer (batch, sequence) tensors."
            )
    token_roles = [f for f in facts if f["role"] in ("tokens", "labels", "targets")]
    if facts and not token_roles:
        raise ModelError(
            f"The model {spec!r} has no token input ({', '.join(names)}), so there is nothing to "
            f"draw training data for; mark the token ids with --input NAME=tokens. {INPUT_HELP}"
        )
    return [{k: f[k] for k in ("name", "role", "dtype", "shape", "vocab")} for f in facts]
