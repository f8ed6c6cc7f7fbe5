"""parastream.core: what the rewrite search, the build pipeline and the launcher share, and nothing above it.

* :mod:`.errors`   - the user-facing errors (one sentence, an exit status);
* :mod:`.tensors`  - ``TensorSpec`` and the one seeded random-input generator (``random_feeds``);
* :mod:`.dataflow` - the one producer/consumer map (plain Python over tensor names: the runtime uses it too);
* :mod:`.graph`    - over an onnx-graphsurgeon graph: the node DAG's edges, static shapes, Conv attributes;
* :mod:`.schedule` - the one list scheduler: the search's cost and the plan's streams and branches;
* :mod:`.accuracy` - the scaled error and its tolerance per precision;
* :mod:`.protos`   - protobuf messages field by field across protobuf versions (``is_repeated``, ``copy_fields``).

Layers: core <- rewrite <- pipeline, and core <- launcher <- pipeline (tests/test_layers.py holds them)."""
