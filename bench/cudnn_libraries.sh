#!/usr/bin/env bash
# Which libcudnn a process loads, torch's and cuDNN's frontend's, with and without the interpreter's LIBDIR first on
# LD_LIBRARY_PATH (what a Triton stub's environment holds: docs/triton.md), and the versions each reports: a stub
# whose cuDNN differs from the build's refuses the plans a bundle ships (cudnn_plans' device tag).
# Usage, on the device after `source bench/device_env.sh`: bash bench/cudnn_libraries.sh
probe='import torch, json
torch.zeros(1, device="cuda")
import cudnn
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcudnn" in l and l.split()[-1].endswith(tuple("0123456789"))})
print(json.dumps({"torch_cudnn": torch.backends.cudnn.version(), "frontend_cudnn": cudnn.backend_version(), "libcudnn_mapped": [m for m in maps if "/libcudnn.so" in m]}))'
libdir=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
echo "LIBDIR $libdir; libcudnn there: $(ls "$libdir"/libcudnn.so* 2>/dev/null | tr '\n' ' ')"
echo "plain: $(python3 -c "$probe")"
echo "LIBDIR first: $(LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 -c "$probe")"
