#!/usr/bin/env bash
# The wheels that parastream, tests/triton_server and bench/triton_gpu.py need on the device machine (Python 3.12, x86-64),
# downloaded here into .whl/ (ignored by git; carried with `carry: [".whl"]`, installed by bench/device_env.sh).
# nvidia-pytriton's wheel (55 MB) is cut down to what serves on Python 3.12: its bundled libpython3.13 and the
# stubs for the other Python versions are deleted from the zip (40 MB left), and the rest carried as an xz tar
# (below), so that the tree carried stays under the device's 64 MiB. tritonclient's generated code needs protobuf >= 6.33 and grpcio >= 1.81.1 at
# run time, so those travel too (the device's own versions are not known here).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
git check-ignore -q .whl/x.whl || { echo ".whl/ is not ignored: echo /.whl/ >> .git/info/exclude first" >&2; exit 1; }
platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
tarball=.whl/nvidia_pytriton-0.7.0.tar.xz  # nvidia-pytriton as carried (below): downloaded only where it is not there
server=(nvidia-pytriton==0.7.0)
[ ! -f "$tarball" ] || server=()
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    "${server[@]}" tritonclient==2.73.0 geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 \
    zope.event==6.2 zope.interface==8.7 python-rapidjson==1.25 brotli==1.2.1 grpcio==1.85.1 protobuf==6.33.6 \
    nvidia-cudnn-frontend==1.22.1  # cuDNN's frontend: plans serialized into bundles (launcher/engines/cudnn_plans.py)
# parastream's own pure-Python dependencies that the device's Python lacks (bench/device_env.sh installs them all)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any -d .whl \
    onnx-graphsurgeon==0.6.1 polygraphy==0.53.6 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 networkx==3.7 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3 \
    nvidia-ml-py==13.615.71  # NVML's bindings: bench/timing_hold.py --states reads the GPU's clocks while it times
if [ ! -f "$tarball" ]; then
    wheel=$(ls .whl/nvidia_pytriton-0.7.0-*.whl)
    # the libpython it bundles (the device's Python has its own) and the stubs of the other Python versions
    zip -q -d "$wheel" 'nvidia_pytriton.libs/libpython3-*' \
        'pytriton/tritonserver/python_backend_stubs/3.8/*' 'pytriton/tritonserver/python_backend_stubs/3.9/*' \
        'pytriton/tritonserver/python_backend_stubs/3.10/*' 'pytriton/tritonserver/python_backend_stubs/3.11/*' \
        'pytriton/tritonserver/python_backend_stubs/3.13/*'
    # carried as the wheel's installed tree in an xz tar (bench/device_env.sh unpacks it into the same --target):
    # 24.8 MiB against the zip's 37.7, so that the tracked tree (~13 MiB), the other wheels and a `.before/` tree
    # still fit the 64 MiB a device call carries.  A wheel with no .data folder installs as its zip's files.
    tree=$(mktemp -d)
    unzip -q "$wheel" -d "$tree"
    [ ! -d "$tree"/nvidia_pytriton-0.7.0.data ] || { echo "nvidia-pytriton's wheel has a .data folder: install it with pip" >&2; exit 1; }
    (cd "$tree" && tar -cf - *) | xz -9 -T0 > "$tarball.part" && mv "$tarball.part" "$tarball"  # its entries, not "."
    rm -rf "$tree" "$wheel"
fi
du -ch .whl/* | tail -1
