"""A sequence grid served by NVIDIA's tritonserver (CPU, onnxruntime engines): a 1-layer BERT built with batch
1..2 and sequence 1..16 (buckets 8, 16), exported in graph mode with -1 on the sequence; requests of several
lengths over HTTP and gRPC, concurrent ones batched where their lengths agree, each answered with ONNX
Runtime's outputs on its unpadded input; a length out of range gets the error naming the axis and range."""

from __future__ import annotations

import threading

import onnxruntime as ort
import pytest
from dynamic_models import bert_feeds, tiny_bert
from triton_clients import PROTOCOLS, client_of, make_inputs
from triton_clients import infer as _infer
from tritonserver_process import built_and_served

from parastream.core.accuracy import scaled_error

pytestmark = [pytest.mark.usefixtures("tritonserver_or_skip"), pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tritonserver_or_skip):
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("dynshapes")
    path = tiny_bert(work / "bert.onnx")
    with built_and_served(path, work, tmp_path_factory.mktemp("tritonserver"), "bert_seq", "--min-shapes", "input_ids:1x1",
                          "--max-shapes", "input_ids:2x16", "--buckets", "input_ids:1=8,16") as srv:
        yield srv, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_any_length_in_range_equals_onnxruntime_unpadded(served, protocol):
    from tritonclient.utils import InferenceServerException

    server, sess = served
    client = client_of(server, protocol)
    try:
        for n, seq in [(1, 3), (2, 8), (1, 13), (2, 16)]:
            feeds = bert_feeds(n, seq, seed=seq)
            got = _infer(client, protocol, "bert_seq", make_inputs(protocol, feeds), ["hidden"])["hidden"]
            want = sess.run(None, feeds)[0]
            assert got.shape == want.shape and scaled_error(got, want) <= 1e-5, (n, seq)
        with pytest.raises(InferenceServerException, match=r"outside this bundle's range 1\.\.16 on axis 'seq'"):
            _infer(client, protocol, "bert_seq", make_inputs(protocol, bert_feeds(1, 17)), ["hidden"])
        assert client.is_model_ready("bert_seq")
    finally:
        client.close()


def test_concurrent_requests_of_several_lengths_each_get_their_own(served):
    server, sess = served
    errors: list[str] = []

    def run(c: int) -> None:
        client = client_of(server, "http")
        try:
            for i in range(6):
                seq = (5, 5, 11, 16)[(c + i) % 4]
                feeds = bert_feeds(1, seq, seed=100 * c + i)
                got = _infer(client, "http", "bert_seq", make_inputs("http", feeds), ["hidden"])["hidden"]
                err = scaled_error(got, sess.run(None, feeds)[0])
                if err > 1e-5:
                    errors.append(f"client {c} request {i} (length {seq}): scaled error {err}")
        except Exception as e:  # noqa: BLE001 - reported below, with the server's log
            errors.append(f"client {c}: {e}")
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"{errors}\n{server.log_tail()}"
