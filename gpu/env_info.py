"""Prints KEY=VALUE lines about one framework, run natively (no shim), so
run_suite.sh knows what is installed and usable. Usage: env_info.py torch|cupy|jax|pynvml"""

import os
import sys

what = sys.argv[1] if len(sys.argv) > 1 else ""


def say(k, v):
    print(f"{k}={' '.join(str(v).split())}", flush=True)


try:
    if what == "torch":
        import torch
        say("torch", torch.__version__)
        say("torch_cuda", torch.version.cuda)
        ok = torch.cuda.is_available()
        say("torch_gpu", ok)
        if ok:
            say("torch_device", torch.cuda.get_device_name(0))
            say("torch_cudnn", torch.backends.cudnn.version())
    elif what == "cupy":
        import cupy
        say("cupy", cupy.__version__)
        say("cupy_runtime", cupy.cuda.runtime.runtimeGetVersion())
        n = cupy.cuda.runtime.getDeviceCount()
        say("cupy_gpu", n > 0)
    elif what == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax
        say("jax", jax.__version__)
        try:
            import jaxlib
            say("jaxlib", jaxlib.__version__)
        except Exception:  # noqa: BLE001
            pass
        say("jax_backend", jax.default_backend())
        say("jax_gpu", jax.default_backend() == "gpu")
        say("jax_devices", [str(d) for d in jax.devices()])
    elif what == "pynvml":
        import pynvml
        say("pynvml", getattr(pynvml, "__version__", "present"))
    else:
        say("error", f"unknown framework {what!r}")
        sys.exit(2)
except Exception as e:  # noqa: BLE001
    say(f"{what}_error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    sys.exit(1)
