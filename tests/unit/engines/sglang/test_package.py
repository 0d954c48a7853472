"""Holds the FAKE SGLang server (tests/fakes, NOT SGLang) and the adapter's request bodies to the
installed SGLang package's own source: the routes they use, the request fields they send or read,
the trace file names and the per-forward range names.

SGLang's modules do not import on a CPU-only machine (its io_struct pulls in torchvision, CUDA
kernels and more), so its source is parsed with `ast`, never imported. SGLang is not a dependency
of this project: install its source alone with `pip install --no-deps sglang==0.5.23` (the pin
these checks were written against; the README's test command does); without it, the package
checks fail. The checkers return their problems, and each has a test that feeds it a drifted
fake and sees it fail.
"""

from __future__ import annotations
import __future__

import ast
import enum
import importlib.metadata
import importlib.util
import inspect
import re
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import fake_sglang_scheduler, fake_sglang_server, fake_sglang_weight_group
from fakes.fake_sglang_scheduler import step_span_name, trace_file_name
from fastapi.routing import APIRoute
from pydantic import BaseModel

from serve_app.engines.sglang import client as sglang_client
from serve_app.engines.sglang import engine as sglang_engine
from serve_app.engines.sglang import server as sglang_server
from serve_app.engines.sglang.engine import segment_prefix
from serve_app.engines.sglang.trace_dialect import SGLANG_DIALECT, SGLANG_FORWARD

_SPEC = importlib.util.find_spec("sglang")  # finds the package without importing it


@pytest.fixture
def sglang_source() -> None:
    """Fails (not skips) without SGLang's source: the README's test command installs it, and a
    run without it must not pass these checks by skipping them."""
    if _SPEC is None or not _SPEC.submodule_search_locations:
        pytest.fail("SGLang's source is not installed: pip install --no-deps sglang==0.5.23")


needs_sglang = pytest.mark.usefixtures("sglang_source")

# -- SGLang's source, parsed --------------------------------------------------------------------

_HTTP_VERBS = {"get", "post", "put", "delete", "patch"}


def sglang_file(rel: str) -> Path:
    """A file of the installed SGLang package, `rel` relative to its `sglang/` directory."""
    assert _SPEC is not None and _SPEC.submodule_search_locations
    return Path(next(iter(_SPEC.submodule_search_locations))) / rel


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def _tree(rel: str) -> ast.Module:
    return ast.parse(sglang_file(rel).read_text(), filename=rel)


def _class_name(annotation: ast.expr | None) -> str | None:
    """The request class of a route parameter's annotation: `X`, `Optional[X]`, `X | None`,
    `Annotated[X, Body()]`."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Subscript):
        inner = annotation.slice
        first = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
        return _class_name(first)
    if isinstance(annotation, ast.BinOp):  # X | None
        return _class_name(annotation.left)
    return None


def http_routes(tree: ast.Module) -> dict[str, tuple[set[str], str | None]]:
    """SGLang's HTTP routes (`@app.get/post/api_route(...)` in http_server.py): path → (methods,
    the request class of the handler's `obj` parameter, if any)."""
    routes: dict[str, tuple[set[str], str | None]] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg: a.annotation for a in fn.args.args}
        body_class = _class_name(params.get("obj"))
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if not (isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            if not (dec.args and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue  # a path from the environment (ollama, vertex): not one we use
            verb = dec.func.attr
            if verb in _HTTP_VERBS:
                methods = {verb.upper()}
            elif verb == "api_route":
                methods = {
                    m.value
                    for k in dec.keywords
                    if k.arg == "methods" and isinstance(k.value, ast.List)
                    for m in k.value.elts
                    if isinstance(m, ast.Constant) and isinstance(m.value, str)
                }
            else:
                continue
            old = routes.get(dec.args[0].value, (set(), None))
            routes[dec.args[0].value] = (old[0] | methods, body_class or old[1])
    return routes


def class_fields(tree: ast.Module) -> dict[str, set[str]]:
    """Field names of every class in a module (annotated class attributes, the keyword
    arguments of an `__init__`, and those of base classes defined in the same module)."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = {
            s.target.id
            for s in cls.body
            if isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and "ClassVar" not in ast.unparse(s.annotation)
        }
        for s in cls.body:
            if isinstance(s, ast.FunctionDef) and s.name == "__init__":
                fields |= {a.arg for a in [*s.args.args, *s.args.kwonlyargs] if a.arg != "self"}
        own[cls.name] = fields
        bases[cls.name] = [b.id for b in cls.bases if isinstance(b, ast.Name)]

    def resolve(name: str) -> set[str]:
        return own.get(name, set()).union(*(resolve(b) for b in bases.get(name, [])))

    return {name: resolve(name) for name in own}


def _function(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"SGLang {sglang_version()} has no function {name}")


def _assigns(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in names for n in ast.walk(node))


def sglang_trace_file_name(profile_prefix: str, profile_id: str) -> str:
    """The file name SGLang's profiler manager gives one recording of rank 0 without DP/PP/EP
    (`_stop_profile` in scheduler_components/profiler_manager.py): its own statements, run."""
    fn = _function(_tree("srt/managers/scheduler_components/profiler_manager.py"), "_stop_profile")
    stmts: list[ast.stmt] = [s for s in fn.body if _assigns(s, {"stage_prefix", "stage_suffix"})]
    for node in ast.walk(fn):
        body = getattr(node, "body", None)
        if isinstance(body, list) and any(isinstance(s, ast.Assign) and _assigns(s, {"filename"}) for s in body):
            first = next(i for i, s in enumerate(body) if _assigns(s, {"filename_parts"}))
            last = next(i for i, s in enumerate(body) if isinstance(s, ast.Assign) and _assigns(s, {"filename"}))
            stmts += body[first : last + 1]
            break
    else:
        raise AssertionError(f"SGLang {sglang_version()}'s _stop_profile builds no `filename`")
    ranks = SimpleNamespace(tp_rank=0, num_dp_ranks=1, dp_rank=0, pp_size=1, pp_rank=0, moe_ep_size=1, moe_ep_rank=0)
    scope: dict[str, Any] = {
        "self": SimpleNamespace(profile_prefix=profile_prefix, profile_id=profile_id),
        "stage": None,
        "get_parallel": lambda: ranks,
    }
    exec(compile(ast.Module(body=stmts, type_ignores=[]), "profiler_manager.py", "exec"), scope)
    return str(scope["filename"])


class _ForwardMode(enum.Enum):
    """Stand-in for SGLang's ForwardMode (only the names matter to the span name)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


def sglang_step_span_name(mode: str, batch_size: int, extend_tokens: int) -> str:
    """SGLang's name for the range around one forward (`build_step_span_name` in
    srt/utils/profile_utils.py, without detailed annotations): its own function, run."""
    fn = _function(_tree("srt/utils/profile_utils.py"), "build_step_span_name")
    scope: dict[str, Any] = {
        "ForwardMode": _ForwardMode,
        "detailed_annotations_enabled": lambda: False,
        "build_detailed_annotation_suffix": lambda batch: "",
    }
    code = compile(
        ast.Module(body=[fn], type_ignores=[]),
        "profile_utils.py",
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, scope)
    batch = SimpleNamespace(forward_mode=_ForwardMode[mode], batch_size=batch_size, extend_num_tokens=extend_tokens)
    return str(scope["build_step_span_name"](batch, detailed_annotations=False))


def forward_range_problems() -> list[str]:
    """Whether SGLang still opens the named range around every forward of its model runner, as a
    torch `record_function` (a `user_annotation` in the trace)."""
    problems = []
    forward = _function(_tree("srt/model_executor/model_runner.py"), "forward")
    wrapped = [
        c
        for c in ast.walk(forward)
        if isinstance(c, ast.Call)
        and isinstance(c.func, ast.Name)
        and c.func.id == "profile_range"
        and c.args
        and isinstance(c.args[0], ast.Call)
        and isinstance(c.args[0].func, ast.Name)
        and c.args[0].func.id == "build_step_span_name"
    ]
    if not wrapped:
        problems.append("ModelRunner.forward no longer opens profile_range(build_step_span_name(...))")
    impl = ast.unparse(_tree("srt/utils/nvtx_utils.py"))
    if "torch.profiler.record_function(debug_name)" not in impl:
        problems.append("profile_range no longer emits torch.profiler.record_function(debug_name)")
    return problems


# -- what the fake and the adapter use ----------------------------------------------------------


def fake_routes() -> dict[str, tuple[set[str], type[BaseModel] | None]]:
    """The fake server's routes as its FastAPI app serves them: path → (methods, body model)."""
    app = fake_sglang_server.build_app(typing.cast(Any, SimpleNamespace()))  # no scheduler runs
    routes: dict[str, tuple[set[str], type[BaseModel] | None]] = {}
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        hints = typing.get_type_hints(route.endpoint)
        body = next(
            (
                a
                for a in (hints.get("obj"),)
                for a in [*typing.get_args(a), a]
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
        old = routes.get(route.path, (set(), None))
        routes[route.path] = (old[0] | set(route.methods), body or old[1])
    return routes


def adapter_routes() -> set[str]:
    """Every route the adapter calls: the string literals that name one in its modules."""
    found = set()
    for module in (sglang_engine, sglang_client, sglang_server):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"/[a-z_]+", node.value):
                found.add(node.value)
    return found


ADAPTER_BODIES: dict[str, type[BaseModel]] = {
    "/start_profile": sglang_client.StartProfileBody,
    "/update_weights_from_disk": sglang_client.UpdateWeightsFromDiskBody,
    "/generate": sglang_client.GenerateBody,
    "/pause_generation": sglang_client.PauseGenerationBody,
    "/continue_generation": sglang_client.ContinueGenerationBody,
    "/abort_request": sglang_client.AbortRequestBody,
    # The weight routes a trainer reaches through engine_rpc, each with the body it is held to.
    **dict(sglang_engine.ENGINE_RPC_ROUTES.values()),
}
"""The body the adapter sends on each route (sglang_client.py)."""

FAKE_TEST_ROUTES = {"/get_weights_by_name"}
"""Routes of SGLang's that the fake serves for tests to read it (the adapter never calls them)."""


def route_problems(sglang: dict[str, tuple[set[str], str | None]], used: dict[str, set[str]], who: str) -> list[str]:
    """Routes (path → methods) `who` uses that SGLang does not serve with those methods."""
    problems = []
    for path, methods in sorted(used.items()):
        if path not in sglang:
            problems.append(f"{who} uses {path}, which SGLang {sglang_version()} does not serve")
        elif missing := methods - sglang[path][0]:
            problems.append(f"{who} serves {path} with {sorted(missing)}; SGLang only with {sorted(sglang[path][0])}")
    return problems


def field_problems(sglang_fields: set[str], used: set[str], where: str) -> list[str]:
    """Fields `where` sends or reads that SGLang's request class does not have."""
    return [f"{where}: {name!r} is not a field in SGLang {sglang_version()}" for name in sorted(used - sglang_fields)]


def body_problems(
    sglang: dict[str, tuple[set[str], str | None]], classes: dict[str, set[str]], bodies: dict[str, set[str]], who: str
) -> list[str]:
    """For each route's body fields (`bodies`: path → fields), the ones SGLang's request class for
    that route lacks."""
    problems = []
    for path, fields in sorted(bodies.items()):
        cls = sglang.get(path, (set(), None))[1]
        if cls is None or cls not in classes:
            problems.append(f"{who}: SGLang {sglang_version()} has no request class for {path}")
            continue
        problems += field_problems(classes[cls], fields, f"{who} {path} ({cls})")
    return problems


# -- the checks against the installed package -----------------------------------------------------


@pytest.fixture(scope="module")
def sglang_routes() -> dict[str, tuple[set[str], str | None]]:
    return http_routes(_tree("srt/entrypoints/http_server.py"))


@pytest.fixture(scope="module")
def io_structs() -> dict[str, set[str]]:
    return class_fields(_tree("srt/managers/io_struct.py"))


@needs_sglang
def test_sglang_package_serves_every_route_the_fake_and_the_adapter_use(sglang_routes):
    fake = {path: methods for path, (methods, _) in fake_routes().items()}
    assert set(fake) >= adapter_routes(), "the fake must serve every route the adapter calls"
    problems = route_problems(sglang_routes, fake, "the fake")
    problems += route_problems(sglang_routes, {p: set() for p in adapter_routes()}, "the adapter")
    assert not problems, "\n".join(problems)


@needs_sglang
def test_sglang_package_request_classes_have_every_field_the_fake_and_the_adapter_use(sglang_routes, io_structs):
    fake = {path: set(body.model_fields) for path, (_, body) in fake_routes().items() if body is not None}
    adapter = {path: set(body.model_fields) for path, body in ADAPTER_BODIES.items()}
    assert set(fake) - FAKE_TEST_ROUTES == set(adapter), (
        "the fake reads a body on exactly the routes the adapter sends one"
    )
    problems = body_problems(sglang_routes, io_structs, fake, "the fake")
    problems += body_problems(sglang_routes, io_structs, adapter, "the adapter")
    # What the fake's scheduler takes from a profile request, and the sampling keywords.
    problems += field_problems(
        io_structs["ProfileReq"], set(fake_sglang_scheduler.ProfileReq.__dataclass_fields__), "fake ProfileReq"
    )
    sampling = class_fields(_tree("srt/sampling/sampling_params.py"))["SamplingParams"]
    problems += field_problems(sampling, set(sglang_client.SamplingParams.model_fields), "adapter sampling_params")
    fake_sampling = set(fake_sglang_scheduler.SamplingParams.__dataclass_fields__)
    problems += field_problems(sampling, fake_sampling, "fake SamplingParams")
    assert not problems, "\n".join(problems)


@needs_sglang
def test_sglang_package_names_trace_files_as_the_fake_does_and_the_adapter_reads():
    prefix = segment_prefix("step3-tagged", 2)
    name = sglang_trace_file_name(prefix, "1712345678.25")
    assert name == trace_file_name(prefix, "1712345678.25") == "step3-tagged-v2-1712345678.25-TP-0.trace.json.gz"
    assert SGLANG_DIALECT.file_version_of(name) == 2


@needs_sglang
def test_sglang_package_labels_each_forward_as_the_fake_does_and_the_adapter_counts():
    assert not forward_range_problems()
    for mode, bs, toks in (("DECODE", 3, 0), ("EXTEND", 2, 9)):
        name = sglang_step_span_name(mode, bs, toks)
        assert name == step_span_name(mode, bs, toks) and name.startswith(SGLANG_FORWARD), name


def process_group_problems(sglang: ast.Module, fake: ast.Module) -> list[str]:
    """Whether the fake forms its weight-update group with SGLang's `init_custom_process_group`,
    statement for statement (docstrings and comments aside)."""

    def body(tree: ast.Module) -> str:
        fn = _function(tree, "init_custom_process_group")
        stmts = fn.body[1:] if ast.get_docstring(fn) else fn.body
        return ast.dump(ast.Module(body=[*stmts], type_ignores=[])) + ast.dump(fn.args)

    if body(sglang) != body(fake):
        return ["the fake's init_custom_process_group is not SGLang's (tests/fakes/fake_sglang_weight_group.py)"]
    return []


@needs_sglang
def test_sglang_package_forms_the_weight_update_group_as_the_fake_does():
    fake = ast.parse(inspect.getsource(fake_sglang_weight_group))
    assert not process_group_problems(_tree("srt/utils/common.py"), fake)
    # SGLang's model runner joins as rank_offset + tp_rank, by TCP rendezvous at the trainer's address.
    init = ast.unparse(
        _function(_tree("srt/model_executor/model_runner_components/weight_updater.py"), "init_weights_update_group")
    )
    assert "rank = rank_offset + self.tp_rank" in init and "init_method=na.to_tcp()" in init, init


def flush_problems(fn: ast.AST, says: tuple[str, ...], does: tuple[str, ...], where: str) -> list[str]:
    """What SGLang's function `fn` no longer has of what the fake copies from it: the strings it
    answers with (`says`) and the code of its conditions (`does`)."""
    said = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    source = ast.unparse(fn)
    return [f"{where} no longer says {s!r}, which the fake answers" for s in says if s not in said] + [
        f"{where} no longer does `{c}`, which the fake copies" for c in does if c not in source
    ]


def sglang_flush_problems() -> list[str]:
    """Whether SGLang refuses a cache flush as the fake does: only when fully idle (waiting
    requests aside while paused), `/flush_cache` answering 400 then, and a weight update whose
    flush is refused failing with SGLang's message after its load."""
    updater = _tree("srt/managers/scheduler_components/weight_updater.py")
    return [
        *flush_problems(
            _function(_tree("srt/entrypoints/http_server.py"), "flush_cache"),
            (fake_sglang_server.CACHE_FLUSHED, fake_sglang_server.FLUSH_FAILED),
            ("200 if ret.success else HTTPStatus.BAD_REQUEST",),
            "/flush_cache",
        ),
        *flush_problems(
            _function(_tree("srt/managers/scheduler.py"), "flush_cache"),
            (),
            ("self.is_fully_idle(ignore_waiting=self._engine_paused)",),
            "Scheduler.flush_cache",
        ),
        *flush_problems(
            _function(updater, "flush_cache_after_weight_update"),
            (fake_sglang_scheduler.FLUSH_REFUSED_AFTER_UPDATE,),
            ("recv_req.flush_cache and (not self.flush_cache(",),
            "flush_cache_after_weight_update",
        ),
        *flush_problems(
            _function(updater, "update_weights_from_disk"),
            (),
            ("self.flush_cache_after_weight_update(recv_req, success, message)",),
            "update_weights_from_disk",
        ),
    ]


@needs_sglang
def test_sglang_package_refuses_a_cache_flush_as_the_fake_does():
    assert not sglang_flush_problems()


def test_sglang_package_flush_check_fails_on_a_drifted_answer_or_condition():
    fn = ast.parse("""
def flush_cache(self):
    if self.is_fully_idle():
        return "Cache flushed."
""")
    assert not flush_problems(fn, ("Cache flushed.",), ("self.is_fully_idle()",), "f")
    assert flush_problems(fn, ("Cache flushed!",), ("self.is_fully_idle(ignore_waiting=True)",), "f") == [
        "f no longer says 'Cache flushed!', which the fake answers",
        "f no longer does `self.is_fully_idle(ignore_waiting=True)`, which the fake copies",
    ]


def test_sglang_package_group_check_fails_on_a_drifted_group_formation():
    fake = ast.parse(inspect.getsource(fake_sglang_weight_group))
    assert not process_group_problems(fake, fake)
    drifted = ast.parse(inspect.getsource(fake_sglang_weight_group).replace("store.set_timeout(timeout)", "pass"))
    assert process_group_problems(drifted, fake)


# -- the checkers fail on drift (no SGLang needed: they get SGLang's side as data) ---------------

SGLANG_SAMPLE = ast.parse("""
from typing import Annotated, Optional
from fastapi import Body

class BaseReq:
    rid: Optional[str] = None

class ProfileReq(BaseReq):
    output_dir: Optional[str] = None
    profile_prefix: Optional[str] = None

class InitWeightsUpdateGroupReqInput(BaseReq, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"

@app.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile_async(obj: Annotated[Optional[ProfileReq], Body()] = None): ...

@app.get("/health")
@app.get("/health_generate")
async def health(request): ...

@app.post("/init_weights_update_group")
async def init_weights_update_group(obj: Annotated[InitWeightsUpdateGroupReqInput, Body()], request): ...

@app.post(os.environ.get("SOME_ROUTE", "/api/chat"))
async def chat(request): ...
""")


def test_sglang_package_checkers_read_routes_and_fields_as_sglang_declares_them():
    routes = http_routes(SGLANG_SAMPLE)
    assert routes == {
        "/start_profile": ({"GET", "POST"}, "ProfileReq"),
        "/health": ({"GET"}, None),
        "/health_generate": ({"GET"}, None),
        "/init_weights_update_group": ({"POST"}, "InitWeightsUpdateGroupReqInput"),
    }
    assert class_fields(SGLANG_SAMPLE)["ProfileReq"] == {"rid", "output_dir", "profile_prefix"}


def test_sglang_package_checkers_fail_on_a_drifted_route_method_or_field(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "test")
    routes, classes = http_routes(SGLANG_SAMPLE), class_fields(SGLANG_SAMPLE)
    assert not route_problems(routes, {"/start_profile": {"POST"}, "/health": {"GET"}}, "the fake")
    assert route_problems(routes, {"/start_profiles": {"POST"}}, "the fake") == [
        "the fake uses /start_profiles, which SGLang test does not serve"
    ]
    assert route_problems(routes, {"/health": {"POST"}}, "the fake") == [
        "the fake serves /health with ['POST']; SGLang only with ['GET']"
    ]
    assert not body_problems(routes, classes, {"/start_profile": {"output_dir", "profile_prefix"}}, "the fake")
    assert body_problems(routes, classes, {"/start_profile": {"output_dir", "profile_prefixx"}}, "the fake") == [
        "the fake /start_profile (ProfileReq): 'profile_prefixx' is not a field in SGLang test"
    ]
    # A made-up drift of SGLang's weight-update group request: the adapter's body (which has
    # `backend`, absent from this sample's class) is caught.
    init_fields = set(sglang_client.InitWeightsUpdateGroupBody.model_fields)
    assert body_problems(routes, classes, {"/init_weights_update_group": init_fields}, "the adapter") == [
        "the adapter /init_weights_update_group (InitWeightsUpdateGroupReqInput): "
        "'backend' is not a field in SGLang test"
    ]
    assert body_problems(routes, classes, {"/health": {"x"}}, "the adapter") == [
        "the adapter: SGLang test has no request class for /health"
    ]


def test_sglang_package_checks_see_what_the_fake_really_serves_and_sends():
    """The checks read the fake's own app and the adapter's own bodies: a field added to one of
    them is a field checked."""
    routes = fake_routes()
    assert routes["/start_profile"] == ({"GET", "POST"}, fake_sglang_server.ProfileReqInput)
    assert routes["/generate"][1] is fake_sglang_server.GenerateReqInput
    assert {"/start_profile", "/stop_profile", "/update_weights_from_disk", "/generate"} <= adapter_routes()
    assert {"/model_info", "/update_weights_from_distributed", "/init_weights_update_group"} <= adapter_routes()
    assert routes["/update_weights_from_distributed"][1] is fake_sglang_server.UpdateWeightsFromDistributedReqInput
