"""Build and install dcp: the Python package plus its native kernels.

    pip install --no-build-isolation -e .          # torch must already be installed

builds the C++ CPU extension ``dcp._C`` (csrc/*.cpp). When torch was built with CUDA and a CUDA
toolkit is found (CUDA_HOME), ``dcp._C_cuda`` (csrc/merge_cuda.cu) is built too. Environment:
``DCP_NO_EXTENSIONS=1`` skips every extension (pure-Python install, reference kernels only),
``DCP_NO_CUDA=1`` skips the CUDA one, ``MAX_JOBS`` bounds parallel compile jobs.
"""
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _extensions():
    """(ext_modules, cmdclass) for the native kernels; empty when disabled or torch is missing."""
    if _env_flag("DCP_NO_EXTENSIONS"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:  # torch absent: install the pure-Python package only
        print("dcp setup: torch is not importable, skipping the native extensions", file=sys.stderr)
        return [], {}

    cxx_flags = ["-O3", "-fno-math-errno"]  # no -march: the wheel must run on any x86-64 / aarch64
    link_flags = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is header-inlined: it only runs in parallel when compiled with OpenMP.
        # libgomp resolves to the copy torch already loaded (same soname).
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
        # let `import dcp._C` find libc10/libtorch even before `import torch`
        link_flags.append("-Wl,-rpath," + os.path.join(os.path.dirname(torch.__file__), "lib"))
    cpu_sources = ["csrc/bindings.cpp", "csrc/bindings_planner.cpp", "csrc/attention_cpu.cpp",
                   "csrc/kernels_generic.cpp", "csrc/kernels_avx2.cpp", "csrc/rounds.cpp", "csrc/pieces.cpp",
                   "csrc/sim.cpp", "csrc/fill.cpp", "csrc/estimate.cpp", "csrc/stages.cpp", "csrc/box_counts.cpp",
                   "csrc/magi_place.cpp"]
    ext_modules = [
        CppExtension(
            name="dcp._C",
            sources=cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ]
    if torch.version.cuda is not None and CUDA_HOME is not None and not _env_flag("DCP_NO_CUDA"):
        ext_modules.append(
            CUDAExtension(
                name="dcp._C_cuda",
                sources=["csrc/bindings_cuda.cpp", "csrc/merge_cuda.cu"],
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]},
            )
        )
    return ext_modules, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="dcp",
    version="0.1.0",
    description="Dynamic context parallelism: block-level planning and execution of long-context attention",
    packages=find_packages(exclude=("tests", "tests.*", "benchmarks", "benchmarks.*", "experiments",
                                    "experiments.*", "paper_figs", "paper_figs.*")),
    package_data={"dcp": ["partition/*.ini"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=["torch", "numpy", "networkx", "kahypar", "mtkahypar"],
    extras_require={
        "gpu": ["flash-attn"],
        "bench": ["matplotlib", "tqdm"],
        "hf": ["transformers>=4.56.2,<5.24"],  # dcp.integration.hf.SUPPORTED_TRANSFORMERS: the tested range
        "test": ["pytest", "hypothesis", "transformers>=4.56.2,<5.24"],
    },
    entry_points={"console_scripts": ["dcp = dcp.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
