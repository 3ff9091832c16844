"""vLLM's own bytecode as CPython specialized it, with and without the instrumentation.

    python -m benchmarks.specialization [--workloads decode-heavy,churn,wide] [--no-control]

CPython 3.11+ rewrites a function's instructions as it runs them (PEP 659): an
attribute read, a method load, a call become instructions specialized for the
classes and instance layouts they met. Instrumentation can slow vLLM's own
code without running a line on its hot path: by changing a class once vLLM's
code has run (its version changes; the instructions specialized for it miss,
fall back and wait up to a few thousand runs before trying again), by making
an instance keep its attributes in a dict, or by handing vLLM's code objects
of other types. None of that is in the hooks' own time
(``benchmarks.hook_time``); all of it is in the paired time. This warms the
real scheduler past its first wave in a fresh process per variant and
compares every instruction of the vLLM functions that ran (``dis``'s adaptive
view): the processes run the same steps, so without such an effect they come
out identical, instruction for instruction (two uninstrumented ones do).

The control, a process instrumented, warmed up, then given vLLM's methods
back (``VLLMKVCacheInstrumentor.uninstrument``) for ``CONTROL_STEPS`` more
steps, changes classes after the warm-up: the comparison must see it.
"""

from __future__ import annotations

import argparse
import dis
import sys
import types
from collections.abc import Iterator

CONTROL_STEPS = 200
VARIANTS = ("base", "otel", "control")


def _code_objects(seen: set[int]) -> Iterator[types.CodeType]:
    """vLLM's code objects (functions, methods, properties, and the code nested in them)
    reachable from its imported modules, not yet in ``seen``."""
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm") or module is None:
            continue
        for value in list(vars(module).values()):
            members = vars(value).values() if isinstance(value, type) and value.__module__ == module_name else [value]
            for member in members:
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if isinstance(member, types.FunctionType) and member.__module__ == module_name:
                    yield from _nested(member.__code__, seen)


def _nested(code: types.CodeType, seen: set[int]) -> Iterator[types.CodeType]:
    if id(code) in seen or "/vllm/" not in code.co_filename:
        return
    seen.add(id(code))
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _nested(constant, seen)


def _instructions(code: types.CodeType, adaptive: bool) -> tuple[str, ...]:
    """The code's instruction names: as written, or as the interpreter has specialized them."""
    return tuple(instruction.opname for instruction in dis.get_instructions(code, adaptive=adaptive))


def specialized(workload_name: str, variant: str) -> dict[str, tuple[str, ...]]:
    """Runs in a fresh process: the instructions of each vLLM function that ran, after the warm-up."""
    from benchmarks.instrumented import instrument, unhook
    from benchmarks.scheduler_driver import Driver, workloads

    workload = {w.name: w for w in workloads()}[workload_name]
    seen: set[int] = set()
    codes = list(_code_objects(seen))  # before instrument() replaces vLLM's methods on their classes
    if variant != "base":
        instrument()
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)
    if variant == "control":
        unhook()
        driver.run(CONTROL_STEPS)
    codes += _code_objects(seen)  # modules vLLM imported meanwhile
    result = {}
    for code in codes:
        adaptive = _instructions(code, adaptive=True)
        if adaptive != _instructions(code, adaptive=False):  # quickened: it ran
            where = code.co_filename.rsplit("/vllm/", 1)[-1]
            result[f"vllm/{where}:{code.co_firstlineno} {code.co_qualname}"] = adaptive
    return result


def compare(base: dict, other: dict) -> dict:
    """Instructions specialized differently, by function; functions that ran in one process only."""
    differing = {}
    for function in base.keys() & other.keys():
        count = sum(a != b for a, b in zip(base[function], other[function]))
        if count:
            differing[function] = count
    return {"differing": differing, "ran_in_one_only": sorted(base.keys() ^ other.keys())}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.scheduler_driver import in_fresh_processes, workloads

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    known = [w.name for w in workloads() if "/" not in w.name]
    parser.add_argument("--workloads", default=",".join(known))
    parser.add_argument("--no-control", action="store_true", help="leave out the control process")
    options = parser.parse_args(argv)
    if sys.version_info < (3, 11):
        print("needs CPython 3.11 or later (no specializing interpreter before)")
        return 1
    chosen = options.workloads.split(",")
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {known}")
    variants = VARIANTS[:2] if options.no_control else VARIANTS
    for name in chosen:
        runs = {variant: dict(in_fresh_processes(specialized, [name], variant))[name] for variant in variants}
        base = runs["base"]
        instructions = sum(map(len, base.values()))
        print(f"{name:<14} vLLM functions that ran: {len(base)} ({instructions} instructions)")
        for variant in variants[1:]:
            outcome = compare(base, runs[variant])
            differing = outcome["differing"]
            label = "instrumented" if variant == "otel" else f"control ({CONTROL_STEPS} steps unhooked)"
            print(
                f"{'':<14} {label}: {sum(differing.values())} instructions specialized differently in "
                f"{len(differing)} functions; {len(outcome['ran_in_one_only'])} functions ran in one process only"
            )
            for function, count in sorted(differing.items(), key=lambda item: -item[1])[:8]:
                print(f"{'':<18} {count:>3}  {function}")
            for function in outcome["ran_in_one_only"][:8]:
                print(f"{'':<18} ran in one only: {function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
