"""Hot wrappers recompiled with the exact parameters of the vLLM method they replace.

CPython specializes each call site for the function it finds there (PEP 659).
vLLM's call of its own method, say ``self.touch(blocks)``, becomes a direct
call of a function taking exactly those arguments; if the function it finds
takes ``*args, **kwargs`` instead, the call site in vLLM's code stays generic,
and every call packs a tuple and a dict that the wrapper unpacks again
(``tests/test_specialization.py`` compares vLLM's instructions with and
without us, and fails on that).

So each wrapper in ``patch.py`` is written once, as a plain closure taking
``(self, *args, **kwargs)``, and ``method_like`` compiles it again from its
own source with vLLM's parameter list: ``*args, **kwargs`` in a call become
the arguments as vLLM gave them, ``args[0]`` the first one. The recompiled
function keeps the closure's file and line numbers, so a traceback through
it shows the wrapper's real source lines in ``patch.py``.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KINDS = (*_POSITIONAL, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)


def method_like(original: Callable[..., Any], method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a closure taking ``self, *args, **kwargs``) with ``original``'s parameters.

    ``method`` itself is returned where ``original`` shows no instance
    parameter (another tool's ``*args`` wrapper without ``functools.wraps``) or
    its source cannot be read. A parameter of vLLM's that shares a name with
    one the closure uses is a TypeError: the hook point is reported, not hooked.
    """
    parameters = list(inspect.signature(original).parameters.values())  # through functools.wraps
    if not parameters or parameters[0].kind not in _POSITIONAL:
        return method
    parameters[0] = parameters[0].replace(name="self")  # vLLM passes the instance positionally
    try:
        lines, first_line = inspect.getsourcelines(method)
    except (OSError, TypeError):  # no source file (a zip without sources)
        return method
    code = method.__code__
    used = set(code.co_varnames) | set(code.co_names) | set(code.co_freevars)
    clash = {p.name for p in parameters} & (used - {"self", "args", "kwargs"})
    if clash:
        raise TypeError(f"{original.__qualname__}: parameters {sorted(clash)} clash with the wrapper's names")

    # "if 1:" lets the closure's indented source parse with its columns as they are.
    module = ast.parse("if 1:\n" + "".join(lines))
    ast.increment_lineno(module, first_line - 2)
    function = module.body[0].body[0]
    defaults = {f"_default_{p.name}": p.default for p in parameters if p.default is not p.empty}
    function.args = _arguments(parameters)
    function.decorator_list = []
    _Forwarding(parameters).visit(function)
    ast.fix_missing_locations(module)
    namespace = {
        **method.__globals__,
        **dict(zip(code.co_freevars, (cell.cell_contents for cell in method.__closure__ or ()))),
        **defaults,
    }
    exec(compile(module, code.co_filename, "exec"), namespace)  # noqa: S102
    return namespace[function.name]


def _arguments(parameters: list[inspect.Parameter]) -> ast.arguments:
    """vLLM's parameter list, each default read from a global ``_default_<name>``."""

    def argument(parameter: inspect.Parameter) -> ast.arg:
        return ast.arg(arg=parameter.name)

    def default(parameter: inspect.Parameter) -> ast.expr:
        return ast.Name(id=f"_default_{parameter.name}", ctx=ast.Load())

    kind = inspect.Parameter
    kinds = {each: [p for p in parameters if p.kind is each] for each in _KINDS}
    positional = kinds[kind.POSITIONAL_ONLY] + kinds[kind.POSITIONAL_OR_KEYWORD]
    var_positional, var_keyword = kinds[kind.VAR_POSITIONAL], kinds[kind.VAR_KEYWORD]
    return ast.arguments(
        posonlyargs=[argument(p) for p in kinds[kind.POSITIONAL_ONLY]],
        args=[argument(p) for p in kinds[kind.POSITIONAL_OR_KEYWORD]],
        vararg=argument(var_positional[0]) if var_positional else None,
        kwonlyargs=[argument(p) for p in kinds[kind.KEYWORD_ONLY]],
        kw_defaults=[default(p) if p.default is not p.empty else None for p in kinds[kind.KEYWORD_ONLY]],
        kwarg=argument(var_keyword[0]) if var_keyword else None,
        defaults=[default(p) for p in positional if p.default is not p.empty],
    )


class _Forwarding(ast.NodeTransformer):
    """``f(x, *args, **kwargs)`` -> ``f(x, <vLLM's arguments after the instance>)``,
    and ``args[0]`` -> the first of them."""

    def __init__(self, parameters: list[inspect.Parameter]) -> None:
        self.rest = parameters[1:]  # the instance is the closure's own ``self``

    def _forwarded(self) -> tuple[list[ast.expr], list[ast.keyword]]:
        positional, keywords = [], []
        for p in self.rest:
            name = ast.Name(p.name, ast.Load())
            if p.kind in _POSITIONAL:
                positional.append(name)
            elif p.kind is p.VAR_POSITIONAL:
                positional.append(ast.Starred(name, ast.Load()))
            else:
                keywords.append(ast.keyword(arg=p.name if p.kind is p.KEYWORD_ONLY else None, value=name))
        return positional, keywords

    def visit_Call(self, node: ast.Call) -> ast.Call:
        forwards = node.args and _is_name(node.args[-1], "args", starred=True)
        if forwards and node.keywords and node.keywords[-1].arg is None and _is_name(node.keywords[-1].value, "kwargs"):
            positional, keywords = self._forwarded()
            node.args = node.args[:-1] + positional
            node.keywords = node.keywords[:-1] + keywords
        self.generic_visit(node)
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.expr:
        if _is_name(node.value, "args") and isinstance(node.slice, ast.Constant) and node.slice.value == 0:
            if not self.rest or self.rest[0].kind not in (*_POSITIONAL, inspect.Parameter.VAR_POSITIONAL):
                raise TypeError("the method takes no positional argument after the instance")
            first = ast.Name(self.rest[0].name, ast.Load())
            if self.rest[0].kind is inspect.Parameter.VAR_POSITIONAL:
                first = ast.Subscript(first, ast.Constant(0), ast.Load())
            return ast.copy_location(first, node)
        self.generic_visit(node)
        return node

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in ("args", "kwargs") and node.id not in {p.name for p in self.rest}:
            raise TypeError(f"the wrapper reads {node.id!r} other than to forward vLLM's arguments")
        return node


def _is_name(node: ast.expr, name: str, starred: bool = False) -> bool:
    if starred:
        if not isinstance(node, ast.Starred):
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == name
