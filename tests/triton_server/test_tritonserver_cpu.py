"""The CPU tier: every bundled example, exported with ``parastream export-triton`` (graph mode, onnxruntime
engines, KIND_CPU), loaded and served by NVIDIA's tritonserver, checked over HTTP and gRPC against
onnxruntime on the original model.

One repository, one server for the module (always stopped, also when a test fails):
  * the five examples (``parastream build --backend onnxruntime``, with the rewrite search);
  * ``small_net_b4``: small_net with a batch dimension, built at batch 4, exported with ``--max-batch 4``
    (Triton's dynamic batcher);
  * ``small_net_buckets``: the same built with ``--batch 1:2:4`` (one bucket per batch size 1, 2, 4);
  * ``tampered``: small_net's export with one engine byte changed after the export (hash mismatch);
  * a hidden folder as an interrupted export leaves it behind (``.NAME.XXXX.partial/NAME``).
Every request loop is bounded in count and in time.
"""

from __future__ import annotations

import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.tools import update_model_dims
from triton_clients import PROTOCOLS, client_of, expected, make_inputs, random_feeds
from triton_clients import infer as _infer
from tritonserver_process import ServerError, TritonServer, serving

from parastream.pipeline.cli import main as cli
from parastream.pipeline.triton import validate_repository
from parastream.pipeline.verify import DEFAULT_TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "models").glob("*.onnx"))
RTOL, ATOL = DEFAULT_TOLERANCES["fp32"]
BATCH = 4
LEFTOVER = ".tampered.a1b2c3.partial"
DEADLINE_S = 120  # for any one test's request loop

pytestmark = pytest.mark.usefixtures("tritonserver_or_skip")


def _cli(*argv: str) -> None:
    assert cli(list(argv)) == 0, f"parastream {' '.join(argv)} failed"


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tritonserver_or_skip) -> Path:
    work = tmp_path_factory.mktemp("served")
    repo = work / "repo"
    for model in EXAMPLES:
        _cli("build", str(model), "-o", str(work / f"{model.stem}.bundle"), "--backend", "onnxruntime", "--quiet")
        _cli("export-triton", str(work / f"{model.stem}.bundle"), str(repo), "--name", model.stem)

    # small_net with a symbolic batch dimension (onnx's own tool), built at batch 4
    dynamic = update_model_dims.update_inputs_outputs_dims(
        onnx.load(ROOT / "examples/models/small_net.onnx"), {"input": ["N", 3, 64, 64]}, {"output": ["N", 10]})
    onnx.save(dynamic, work / "small_net_dyn.onnx")
    _cli("build", str(work / "small_net_dyn.onnx"), "-o", str(work / "b4.bundle"), "--backend", "onnxruntime",
         "--shapes", f"input:{BATCH}x3x64x64", "--no-search", "--quiet")
    _cli("export-triton", str(work / "b4.bundle"), str(repo), "--name", "small_net_b4", "--max-batch", str(BATCH))
    # the same model with a dynamic batch: buckets 1, 2, 4 (max_batch_size 4, preferred batch sizes the buckets)
    _cli("build", str(work / "small_net_dyn.onnx"), "-o", str(work / "buckets.bundle"), "--backend", "onnxruntime",
         "--batch", f"1:2:{BATCH}", "--no-search", "--quiet")
    _cli("export-triton", str(work / "buckets.bundle"), str(repo), "--name", "small_net_buckets")

    _cli("export-triton", str(work / "small_net.bundle"), str(repo), "--name", "tampered")
    assert validate_repository(repo) == []
    engine = sorted((repo / "tampered/1/bundle/engines").iterdir())[0]
    engine.write_bytes(engine.read_bytes() + b"\0")
    # what an export that died before its rename leaves in REPO
    shutil.copytree(repo / "tampered", repo / LEFTOVER / "tampered")
    return repo


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    with serving(repo, tmp_path_factory.mktemp("tritonserver")) as srv:
        yield srv


@pytest.fixture(scope="module")
def references(repo):
    """model -> onnxruntime session on the original model (small_net_b4: small_net with its batch dimension)."""
    out = {}
    for model in EXAMPLES:
        sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        out[model.stem] = sess
    out["small_net_b4"] = ort.InferenceSession(str(repo.parent / "small_net_dyn.onnx"), providers=["CPUExecutionProvider"])
    out["small_net_buckets"] = out["small_net_b4"]
    return out


def infer(client, protocol: str, model: str, feeds: dict, outputs: list[str]) -> dict:
    """One request of numpy ``feeds``, each declared with its own data type."""
    return _infer(client, protocol, model, make_inputs(protocol, feeds), outputs)


# -- the tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_models_ready(server, protocol):
    client = client_of(server, protocol)
    try:
        assert client.is_server_live()
        for model in [m.stem for m in EXAMPLES] + ["small_net_b4", "small_net_buckets"]:
            assert client.is_model_ready(model), f"{model} is not ready\n{server.log_tail()}"
        assert not client.is_model_ready("tampered")
    finally:
        client.close()


def test_each_instance_logs_how_long_it_took_to_be_ready(server):
    """model.py's initialize says, in the server's log, how long the instance took (bench/triton_gpu.py reads it)."""
    import re

    log = server.log()
    for model in [m.stem for m in EXAMPLES] + ["small_net_b4", "small_net_buckets"]:
        got = re.findall(rf"parastream: {re.escape(model)}_\d+(?:_\d+)? ready in (\d+\.\d+) s", log)
        assert got and all(0 < float(s) < 300 for s in got), f"{model}: no ready line\n{server.log_tail()}"


def test_stubs_run_this_interpreter(server):
    """Each model instance's stub embeds this interpreter's libpython (see tritonserver_process)."""
    from tritonserver_process import python_library

    pids = server.stub_pids()
    assert len(pids) >= len(EXAMPLES) + 1, f"expected a stub per loaded model, found {pids}"
    want = str(python_library().resolve())
    for pid in pids:
        mapped = {str(Path(p).resolve()) for p in server.libpythons(pid)}
        assert mapped == {want}, f"stub {pid} maps {mapped}, not this interpreter's {want}"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", [m.stem for m in EXAMPLES])
def test_outputs_equal_onnxruntime(server, references, model, protocol):
    sess = references[model]
    feeds = random_feeds(sess, np.random.default_rng(zlib.crc32(f"{model}/{protocol}".encode())))
    want = expected(sess, feeds)
    client = client_of(server, protocol)
    try:
        got = infer(client, protocol, model, feeds, list(want))
    finally:
        client.close()
    for name, ref in want.items():
        assert got[name].shape == ref.shape and got[name].dtype == ref.dtype
        np.testing.assert_allclose(got[name], ref, rtol=RTOL, atol=ATOL, err_msg=f"{model}:{name} over {protocol}")


def test_concurrent_clients(server, references):
    """8 clients (4 HTTP, 4 gRPC) x 100 requests at once: no error, every answer the one for its own input."""
    model, clients, requests = "small_net", 8, 100
    sess = references[model]
    rng = np.random.default_rng(7)
    pool = [random_feeds(sess, rng) for _ in range(32)]
    answers = [expected(sess, f)["output"] for f in pool]
    deadline = time.monotonic() + DEADLINE_S
    done = [0] * clients
    errors: list[str] = []
    lock = threading.Lock()

    def run(c: int) -> None:
        protocol = PROTOCOLS[c % 2]
        client = client_of(server, protocol)
        try:
            for i in range(requests):
                if time.monotonic() > deadline:
                    return
                k = (c * 13 + i * 5) % len(pool)
                try:
                    got = infer(client, protocol, model, pool[k], ["output"])["output"]
                    np.testing.assert_allclose(got, answers[k], rtol=RTOL, atol=ATOL)
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    with lock:
                        errors.append(f"client {c} ({protocol}) request {i}: {type(e).__name__}: {e}"[:500])
                done[c] += 1
        finally:
            client.close()

    with ThreadPoolExecutor(clients) as pool_:
        futures = [pool_.submit(run, c) for c in range(clients)]
        for f in futures:
            f.result(timeout=DEADLINE_S + 60)
    assert not errors, f"{len(errors)} of {sum(done)} requests failed; first: {errors[0]}"
    assert done == [requests] * clients, f"requests done per client within {DEADLINE_S} s: {done}"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_wrong_shape_or_dtype_gets_tritons_error(server, references, protocol):
    from tritonclient.utils import InferenceServerException

    sess = references["small_net"]
    feeds = random_feeds(sess, np.random.default_rng(3))
    want = expected(sess, feeds)["output"]
    client = client_of(server, protocol)
    try:
        # Triton's own checks against config.pbtxt, before model.py sees the request
        with pytest.raises(InferenceServerException, match=r"unexpected shape for input 'input' for model 'small_net'"):
            infer(client, protocol, "small_net", {"input": np.zeros((1, 3, 32, 32), np.float32)}, ["output"])
        with pytest.raises(InferenceServerException, match=r"data-type is 'FP64', but model 'small_net' expects 'FP32'"):
            infer(client, protocol, "small_net", {"input": feeds["input"].astype(np.float64)}, ["output"])
        with pytest.raises(InferenceServerException, match=r"data-type is 'FP16', but model 'small_net' expects 'FP32'"):
            infer(client, protocol, "small_net", {"input": feeds["input"].astype(np.float16)}, ["output"])
        with pytest.raises(InferenceServerException, match=r"batch-size must be <= 4 for 'small_net_b4'"):
            infer(client, protocol, "small_net_b4", {"input": np.zeros((5, 3, 64, 64), np.float32)}, ["output"])
        # the server keeps serving, the same model and the others
        assert client.is_server_live() and client.is_model_ready("small_net") and client.is_model_ready("small_net_b4")
        got = infer(client, protocol, "small_net", feeds, ["output"])["output"]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    finally:
        client.close()


def test_tampered_bundle_fails_to_load_others_load(server):
    log = server.log()
    assert "failed to load 'tampered'" in log
    assert "sha256 differs from manifest.json; the bundle was modified or is corrupt" in log
    assert "tampered/1/bundle/engines/" in log  # parastream's message names the file
    client = client_of(server, "http")
    try:
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["tampered"]["state"] == "UNAVAILABLE"
        assert "sha256 differs from manifest.json" in index["tampered"].get("reason", "")
        for model in [m.stem for m in EXAMPLES] + ["small_net_b4", "small_net_buckets"]:
            assert index[model]["state"] == "READY", index[model]
    finally:
        client.close()
    problems = validate_repository(server.repo)
    assert any("tampered" in p and "sha256 differs" in p for p in problems), problems


def test_hidden_folder_is_a_model_to_triton(server):
    """What the real server taught validate-triton: Triton loads hidden folders as models too."""
    assert f"failed to load model '{LEFTOVER}'" in server.log()
    problems = validate_repository(server.repo)
    assert any(LEFTOVER in p and "hidden" in p for p in problems), problems


def test_with_tritons_default_exit_on_error_a_leftover_folder_stops_the_server(server, tmp_path):
    """The same leftover under Triton's default --exit-on-error=true: the server does not start at all."""
    repo = tmp_path / "repo"
    shutil.copytree(server.repo / "small_net", repo / "small_net")
    shutil.copytree(server.repo / LEFTOVER, repo / LEFTOVER)
    strict = TritonServer(repo, tmp_path / "server", exit_on_error=True)
    with pytest.raises(ServerError, match="exited"):
        try:
            strict.start(timeout=120, attempts=1)
        finally:
            strict.stop()
    log = strict.log()
    assert f"failed to load model '{LEFTOVER}'" in log and "failed to load all models" in log
    shutil.rmtree(repo / LEFTOVER)  # and without it the same repository serves
    assert validate_repository(repo) == []
    with TritonServer(repo, tmp_path / "server2", exit_on_error=True) as ok:
        client = client_of(ok, "http")
        try:
            assert client.is_model_ready("small_net")
        finally:
            client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", ["small_net_b4", "small_net_buckets"])
def test_dynamic_batcher_returns_each_request_its_rows(server, references, protocol, model):
    """Concurrent requests of 1-3 rows to the --max-batch 4 model (padded to 4) and to the dynamic-batch bundle
    (buckets 1, 2, 4: each batch on the smallest bucket that holds it): Triton's dynamic batcher groups them
    (the statistics show fewer executions than requests) and each gets its own rows back."""
    clients, rounds = 6, 12
    sess = references[model]
    sizes = (1, 2, 3, 1)
    stats_client = client_of(server, protocol)

    def executions() -> tuple[int, int]:
        stats = stats_client.get_inference_statistics(model, as_json=True) if protocol == "grpc" else \
            stats_client.get_inference_statistics(model)
        s = stats["model_stats"][0]
        return int(s.get("execution_count", 0)), int(s.get("inference_count", 0))

    def burst(seed: int) -> tuple[list[str], list[int], int, int, int]:
        """Every client's requests sent at once; (errors, requests sent by each client, executions, inferences,
        rows sent)."""
        errors: list[str] = []
        deadline = time.monotonic() + DEADLINE_S
        sent = [0] * clients
        start = threading.Barrier(clients)

        def run(c: int) -> None:
            client = client_of(server, protocol)
            rng = np.random.default_rng(seed + c)
            # every request and its expected rows made first, and the clients started together: the batcher groups
            # requests that wait in its queue together, and a client computing its reference between requests (on
            # a 2-core machine) once sent them too far apart for any to wait (72 executions for 72 requests)
            work = []
            for i in range(rounds):
                feeds = random_feeds(sess, rng, batch=sizes[(c + i) % len(sizes)])
                work.append((i, feeds, expected(sess, feeds)["output"]))
            try:
                start.wait(timeout=DEADLINE_S)
                for i, feeds, want in work:
                    if time.monotonic() > deadline:
                        return
                    try:
                        got = infer(client, protocol, model, feeds, ["output"])["output"]
                        assert got.shape == want.shape, f"shape {got.shape}, want {want.shape}"
                        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
                    except Exception as e:  # noqa: BLE001
                        errors.append(f"client {c} request {i} ({feeds['input'].shape[0]} rows): {e}"[:500])
                    sent[c] += 1
            finally:
                client.close()

        rows = sum(sizes[(c + i) % len(sizes)] for c in range(clients) for i in range(rounds))
        exec0, inf0 = executions()
        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(run, c) for c in range(clients)]:
                f.result(timeout=DEADLINE_S + 60)
        # Triton counts an execution after it has sent the responses: the last ones may land a moment later
        settle = time.monotonic() + 10
        exec1, inf1 = executions()
        while inf1 - inf0 < rows and time.monotonic() < settle:
            time.sleep(0.1)
            exec1, inf1 = executions()
        return errors, sent, exec1 - exec0, inf1 - inf0, rows

    # Triton's batcher (no queue delay in the exported config) groups the requests that wait while a batch runs;
    # whether any wait depends on the host's scheduling (a 2-core CI machine once ran 72 requests as 72
    # executions), so the grouping is asked of one of three bursts, and every burst's rows are checked
    try:
        for attempt in range(3):
            errors, sent, executed, inferred, rows = burst(100 + 10 * attempt)
            assert not errors, errors[0]
            assert sum(sent) == clients * rounds, sent
            assert inferred == rows
            if executed < sum(sent):
                break
    finally:
        stats_client.close()
    assert executed < sum(sent), f"{executed} executions for {sum(sent)} requests in each of 3 bursts: the batcher grouped none"
