# parastream on an NGC TensorRT image: TensorRT 10, CUDA and cuDNN come from the image; parastream and
# what it needs besides are installed on top.
#
#   docker build -t parastream .
#   docker run --rm --gpus all -v "$PWD/models:/models" parastream \
#       build /models/model.onnx -o /models/out --backend tensorrt
#
# BASE_TAG 26.05-py3 carries TensorRT 10.16; any NGC TensorRT 10 tag works, and so does an NGC
# PyTorch image (BASE_IMAGE=nvcr.io/nvidia/pytorch), which has TensorRT and PyTorch both.
ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt
ARG BASE_TAG=26.05-py3
FROM ${BASE_IMAGE}:${BASE_TAG}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/parastream
COPY pyproject.toml README.md ./
COPY pipeline/ pipeline/
COPY rewrite/ rewrite/
COPY launcher/ launcher/
COPY core/ core/

# The image's TensorRT matches its CUDA, cuDNN and driver requirements: pip must not replace it.
# So: (1) the [trt] extra is left out (it would ask pip for a `tensorrt` distribution, which an image
# may register under another name) and cuda-python comes through the [cuda] extra; (2) every NVIDIA
# package the image already has (TensorRT, its CUDA wheels, PyTorch and numpy in a PyTorch image,
# Polygraphy) is pinned to the version it has, so installing parastream adds and replaces nothing
# of the image's stack; (3) the build fails unless the image's TensorRT 10 still imports afterwards.
RUN python3 -m pip list --format=freeze \
      | { grep -iE '^(tensorrt|nvidia-|cuda-|torch|polygraphy|onnx-graphsurgeon|numpy)' || true; } > /tmp/image-stack.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-stack.txt ".[cuda,torch,triton]" \
 && python3 -c "import tensorrt as trt; assert int(trt.__version__.split('.')[0]) >= 10, trt.__version__; print('TensorRT', trt.__version__)" \
 && parastream --help > /dev/null \
 && rm /tmp/image-stack.txt

WORKDIR /models
ENTRYPOINT ["parastream"]
CMD ["--help"]
