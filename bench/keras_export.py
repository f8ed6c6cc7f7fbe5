#!/usr/bin/env python3
"""Keras models exported with tf2onnx, for the public-model corpus (bench/corpus.py).

TensorFlow users reach ONNX through tf2onnx, whose graphs differ from PyTorch's exporters' (channels-last inputs
with Transposes around the convolutions, Conv with SAME pads, its own op forms), so parastream has to take those
too. TensorFlow and torch rarely share one environment, so the export runs here, under a TensorFlow interpreter,
and leaves each model where bench/corpus.py takes a kept export:

    TF_PYTHON bench/keras_export.py --keep /tmp/keep --models MobileNetV2,ResNet50,NASNetMobile
    python3 bench/corpus.py --models keras:MobileNetV2,keras:ResNet50,keras:NASNetMobile --exporters tf2onnx \\
        --keep /tmp/keep --reuse-exports --out /tmp/corpus_keras

Each model is a ``tf.keras.applications`` model with random weights (``weights=None``; no download), its
BatchNormalization statistics taken from random images as training would set them (with the defaults a deep
net's activations grow layer by layer); written as ``keras:NAME__tf2onnx.onnx`` with its example input
(``.npz``), opset 17, batch 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

MODELS = ("MobileNetV2", "MobileNetV3Small", "ResNet50", "ResNet50V2", "InceptionV3", "Xception", "DenseNet121",
          "EfficientNetB0", "EfficientNetV2B0", "NASNetMobile", "ConvNeXtTiny", "VGG16")


def calibrate_batchnorm(model, shape, batches: int = 2, batch_size: int = 4) -> None:
    """BatchNormalization's moving statistics set to those of random images: a few forward passes in training
    mode with momentum 0 (each pass's batch statistics replace the moving ones)."""
    import tensorflow as tf

    def walk(layer):  # Keras 3's models list their own layers only; a nested model lists its own
        yield layer
        for inner in getattr(layer, "layers", ()):
            yield from walk(inner)

    bns = [layer for layer in walk(model) if isinstance(layer, tf.keras.layers.BatchNormalization)]
    for layer in bns:
        layer.momentum = 0.0
    for _ in range(batches):
        model(tf.random.normal((batch_size, *shape[1:])), training=True)


def export(name: str, keep: Path, opset: int = 17) -> Path:
    import tensorflow as tf
    import tf2onnx

    tf.keras.utils.set_random_seed(0)
    model = getattr(tf.keras.applications, name)(weights=None)
    shape = (1, *model.input_shape[1:])
    calibrate_batchnorm(model, shape)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    path = keep / f"keras:{name}__tf2onnx.onnx"
    tf2onnx.convert.from_keras(model, input_signature=[tf.TensorSpec(shape, tf.float32, name="x")], opset=opset,
                               output_path=str(path))
    np.savez(path.with_suffix(".npz"), x=x)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="tf.keras.applications names")
    ap.add_argument("--keep", type=Path, required=True, help="the folder bench/corpus.py --keep reads")
    ap.add_argument("--opset", type=int, default=17)
    args = ap.parse_args(argv)
    args.keep.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in filter(None, args.models.split(",")):
        t0 = time.perf_counter()
        try:
            path = export(name, args.keep, args.opset)
            print(f"{name:20s} {time.perf_counter() - t0:6.1f}s {path}", flush=True)
        except Exception as e:  # noqa: BLE001 - one line per model; the others still export
            failed += 1
            print(f"{name:20s} {time.perf_counter() - t0:6.1f}s failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
