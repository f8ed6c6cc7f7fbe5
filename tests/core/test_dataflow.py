"""The one producer/consumer map (core/dataflow.py) and the graphsurgeon graph utilities (core/graph.py)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from parastream.core.dataflow import consumers, downstream, producers
from parastream.core.graph import conv_attrs, node_edges, static_shape


def test_producers_map_each_tensor_to_its_writer_and_skip_omitted_outputs():
    writes = [["a", ""], ["b", "c"], ["d"]]
    assert producers(writes) == {"a": 0, "b": 1, "c": 1, "d": 2}
    assert producers(iter([["x"], ["x"]])) == {"x": 1}  # a generator; a name written twice: its last writer


def test_consumers_list_each_reader_once_in_item_order():
    reads = [["a", "a"], ["", "a", "b"], ["b"]]  # a Mul(a, a) reads a once as far as the map goes
    assert consumers(reads) == {"a": [0, 1], "b": [1, 2]}


def test_downstream_is_what_reads_the_start_directly_or_not():
    # 0: x -> a; 1: a -> b; 2: x -> c; 3: b, c -> d; 4: d -> e, ""
    reads = [["x"], ["a"], ["x"], ["b", "c"], ["d"]]
    writes = [["a"], ["b"], ["c"], ["d"], ["e", ""]]
    assert downstream(reads, writes, [0]) == {1, 3, 4}
    assert downstream(reads, writes, [2]) == {3, 4}
    assert downstream(reads, writes, [4]) == set()  # nothing reads e (nor the omitted output)
    assert downstream(reads, writes, [0, 1]) == {1, 3, 4}  # a start item read by another start item is in


def _model_with_if():
    then = helper.make_graph([helper.make_node("Identity", ["r"], ["t_out"])], "then", [],
                             [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e_out"])], "else", [],
                              [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Add", ["y", "s"], ["z"], name="add")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                       helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    return gs.import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_node_edges_include_what_a_body_reads_from_outside():
    """The If reads relu's output only inside its then-branch: still an edge relu -> if."""
    graph = _model_with_if()
    preds, succs = node_edges(graph)
    assert preds == [[], [], [0], [2, 1]]
    assert succs == [[2], [3], [3], []]


def test_static_shape_known_dims_only():
    assert static_shape(gs.Variable("v", dtype=np.float32, shape=[1, 3, 8])) == (1, 3, 8)
    assert static_shape(gs.Variable("v", dtype=np.float32, shape=["N", 3])) is None
    assert static_shape(gs.Variable("v", dtype=np.float32, shape=[-1, 3])) is None
    assert static_shape(gs.Variable("v", dtype=np.float32)) is None
    assert static_shape(gs.Constant("w", np.zeros((4, 2, 3, 3), np.float32))) == (4, 2, 3, 3)
    assert static_shape(None) is None


def test_conv_attrs_fill_onnx_defaults():
    w = gs.Constant("w", np.zeros((4, 2, 3, 3), np.float32))
    conv = gs.Node("Conv", inputs=[gs.Variable("x", dtype=np.float32, shape=[1, 2, 8, 8]), w],
                   outputs=[gs.Variable("y")], attrs={"auto_pad": b"VALID"})
    assert conv_attrs(conv, 2) == {"auto_pad": "NOTSET", "dilations": [1, 1], "group": 1, "kernel_shape": [3, 3],
                                   "pads": [0, 0, 0, 0], "strides": [1, 1]}


def test_node_reads_lists_what_bodies_read_from_the_enclosing_scope():
    from onnx import TensorProto, helper, numpy_helper

    from parastream.core.dataflow import node_reads

    inner_if = helper.make_node(
        "If", ["c2"], ["deep"],
        then_branch=helper.make_graph([helper.make_node("Add", ["outer_a", "local"], ["d1"])], "t2", [],
                                      [helper.make_tensor_value_info("d1", TensorProto.FLOAT, None)]),
        else_branch=helper.make_graph([], "e2", [], [helper.make_tensor_value_info("outer_b", TensorProto.FLOAT, None)]))
    body = helper.make_graph(
        [helper.make_node("Neg", ["outer_a"], ["local"]), helper.make_node("Not", ["outer_c"], ["c2"]), inner_if],
        "then", [], [helper.make_tensor_value_info("deep", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros(1, np.float32), "own_weight")])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=body,
                            else_branch=helper.make_graph([helper.make_node("Identity", ["own_weight"], ["z"])], "else",
                                                          [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)]))
    # the listed input first; then the outer names, each once; a body's own tensors and initializers are not read;
    # an initializer of one branch is an outer name for the other
    assert node_reads(node) == ["cond", "own_weight", "outer_a", "outer_c", "outer_b"]  # (attributes by name)
    assert node_reads(helper.make_node("Add", ["a", "b"], ["c"])) == ["a", "b"]
