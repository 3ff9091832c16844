"""Hot-path methods built with the exact parameters of the vLLM method they replace.

A wrapper taking ``(self, *args, **kwargs)`` packs every call's arguments into a
tuple and a dict and unpacks them again to call vLLM's original: on the engine
loop that was over a third of the wrappers' own time (py-spy on churn: 0.81 % of
the step, 0.49 % with exact parameters). So, as ``dataclasses`` builds
``__init__``, the method is compiled from source: vLLM's parameters, defaults
and kinds, and a body that forwards the arguments as they were given. A
keyword call to the original stays a valid call to the wrapper.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_BODY_PROBE = "def method(self):\n{body}"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_ANYTHING = [
    inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
    inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
]


def method_like(original: Callable[..., Any], body: str, names: dict[str, Any]) -> Callable[..., Any]:
    """A function with ``original``'s parameters running ``body`` (indented source).

    In ``body``, ``{self}`` is the instance's parameter, ``{first}`` the first one
    after it and ``{arguments}`` the arguments after the instance, forwarded as
    given; ``names`` are the globals it uses. A parameter may not share a name
    with the body's own (TypeError: the hook point is then reported, not hooked).
    An ``original`` that shows no instance parameter (a wrapper taking ``*args,
    **kwargs`` without ``functools.wraps``) gets ``(self, *args, **kwargs)``.
    """
    parameters = list(inspect.signature(original).parameters.values())  # through functools.wraps
    if not parameters or parameters[0].kind not in _POSITIONAL:
        parameters = _ANYTHING  # e.g. another tool's wrapper around vLLM's method
    instance, rest = parameters[0], parameters[1:]
    clash = {p.name for p in parameters} & (_names_in(body) | set(names))
    if clash:
        raise TypeError(f"{original.__qualname__}: parameters {sorted(clash)} clash with the wrapper's names")
    signature, forwarded, defaults = _source_of(parameters)
    first = None
    if rest and rest[0].kind in _POSITIONAL:
        first = rest[0].name
    elif rest and rest[0].kind is rest[0].VAR_POSITIONAL:
        first = f"{rest[0].name}[0]"  # an IndexError there is the body's to catch
    if first is None and "{first}" in body:
        raise TypeError(f"{original.__qualname__} takes no positional argument after the instance")
    source = f"def method({signature}):\n" + body.format(self=instance.name, first=first, arguments=forwarded)
    namespace = {**names, **defaults}
    exec(compile(source, f"<otel-kvcache wrapper of {original.__qualname__}>", "exec"), namespace)  # noqa: S102
    return namespace["method"]


def _names_in(body: str) -> set[str]:
    """The names ``body`` binds or reads (locals, globals, attributes)."""
    probe = _BODY_PROBE.format(body=body.format(self="self", first="first", arguments=""))
    code = compile(probe, "<probe>", "exec").co_consts[0]
    return (set(code.co_varnames) | set(code.co_names)) - {"self", "first"}


def _source_of(parameters: list[inspect.Parameter]) -> tuple[str, str, dict[str, Any]]:
    """The parameter list as source, the call forwarding the ones after the instance,
    and the defaults (bound by name in the new function's globals)."""
    declared, forwarded, defaults = [], [], {}
    keyword_only_opened = False
    for index, parameter in enumerate(parameters):
        name, kind = parameter.name, parameter.kind
        if kind is parameter.KEYWORD_ONLY and not keyword_only_opened:
            declared.append("*")
        keyword_only_opened |= kind in (parameter.KEYWORD_ONLY, parameter.VAR_POSITIONAL)
        text = {parameter.VAR_POSITIONAL: f"*{name}", parameter.VAR_KEYWORD: f"**{name}"}.get(kind, name)
        if parameter.default is not parameter.empty:
            defaults[f"_default_{name}"] = parameter.default
            text += f"=_default_{name}"
        declared.append(text)
        if kind is parameter.POSITIONAL_ONLY and (
            index + 1 == len(parameters) or parameters[index + 1].kind is not parameter.POSITIONAL_ONLY
        ):
            declared.append("/")
        if index:  # the instance is the caller's to pass
            if kind is parameter.KEYWORD_ONLY:
                forwarded.append(f"{name}={name}")
            else:
                forwarded.append(text.split("=")[0])
    return ", ".join(declared), ", ".join(forwarded), defaults
