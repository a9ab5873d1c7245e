"""Field docstrings -> pydantic descriptions, at documentation time only.

Fields are documented the vLLM way: a docstring under each field. pydantic can
read them at class creation (`use_attribute_docstrings`), but that parses the
source of every class on every start-up; the CLI's cold start cannot afford it.
So the docstrings are read here, when a JSON Schema or docs are generated.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from typing import Any

from pydantic import BaseModel


def field_docstrings(cls: type) -> dict[str, str]:
    """Map field name -> the string literal that follows its annotated assignment in the class body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    body = getattr(node, "body", [])
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def model_tree(root: type[BaseModel]) -> list[type[BaseModel]]:
    """The model and every pydantic model reachable through its field annotations."""
    seen: list[type[BaseModel]] = []

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                return
            seen.append(tp)
            for f in tp.model_fields.values():
                visit(f.annotation)
            return
        for arg in typing.get_args(tp):
            visit(arg)

    visit(root)
    return seen


def attach_docstrings(root: type[BaseModel]) -> None:
    """Copy field docstrings into the FieldInfo descriptions of a model tree and rebuild it."""
    models = model_tree(root)
    for model in models:
        docs: dict[str, str] = {}
        for klass in reversed(model.__mro__):
            if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
                docs.update(field_docstrings(klass))
        for name, info in model.model_fields.items():
            if info.description is None and name in docs:
                info.description = docs[name]
    # Twice: recursive models (AllOf -> Condition -> AllOf) embed each other's schema, so
    # one pass leaves some of them with the copy built before their docs were attached.
    for _ in range(2):
        for model in reversed(models):
            model.model_rebuild(force=True)


def json_schema(model: type[BaseModel], title: str) -> dict[str, Any]:
    """The published JSON Schema of a model: field docstrings as descriptions, draft 2020-12, a title."""
    attach_docstrings(model)
    schema = model.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = title
    return schema
