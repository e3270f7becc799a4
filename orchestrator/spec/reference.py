"""The spec reference as Markdown, generated from the models' field descriptions.

A field's meaning ends with which trainers act on it, where not every model kind does
(``scope.Honoured``, on the field or the section it is in). The README embeds this
output; a test keeps the two identical.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from orchestrator.spec.experiment import Spec
from orchestrator.spec.scope import Honoured, marker
from orchestrator.spec.strict import models_in


def _type_name(annotation) -> str:
    models = models_in(annotation)
    if models:
        return "mapping"
    text = str(annotation).replace("typing.", "")
    if isinstance(annotation, type):
        text = annotation.__name__
    return text.replace("NoneType", "null").replace("Literal", "one of ").replace("|", "or")


def _default(field) -> str:
    if field.default is not PydanticUndefined and not models_in(field.annotation):
        d = field.default
        if d is None:
            return "null"
        return f"`{d}`"
    if field.default_factory is not None and not models_in(field.annotation):
        return f"`{field.default_factory()}`"
    if field.is_required():
        return "**required**"
    return ""


def rows(model: type[BaseModel], prefix: str = "", honoured: Honoured | None = None) -> list[tuple[str, str, str, str]]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        note = marker(field, Honoured, honoured)
        meaning = " ".join(filter(None, [field.description, note and note.note]))
        out.append((path, _type_name(field.annotation), _default(field), meaning.replace("|", "\\|")))
        for sub in models_in(field.annotation):
            kind = sub.model_fields.get("kind")
            label = path
            if kind is not None and len(models_in(field.annotation)) > 1:
                tag = kind.default if isinstance(kind.default, str) else typing.get_args(kind.annotation)[0]
                label = f"{path}[kind={tag}]"
            out.extend(r for r in rows(sub, f"{label}.", note) if not r[0].endswith(".kind"))
    return out


def markdown_reference() -> str:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{p}` | {t} | {d} | {m} |" for p, t, d, m in rows(Spec)]
    return "\n".join(lines)
