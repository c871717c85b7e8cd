"""Compile every CUDA kernel file in csrc/ with nvcc and the flags torch's extension builder really passes, for
sm_90 (H100/H200) and sm_80 (A100), and with ANGLE_KERNELS_TEST_ALL_ARCHS=1 for the rest of setup.py's
architectures, sm_86 and sm_89 (A10, L4, RTX 30xx/40xx: the same code as sm_80, see COMPILED_ARCHS); check each
binding against the kernel file it binds; and check that setup.py survives a failed compile and keeps a kernel
file's object apart from its binding's.

csrc/ holds, per op, `<op>.cu` (kernels and launchers, torch-free) and `<op>.cpp` (its torch binding: the
launcher declarations, the checks, the TORCH_LIBRARY_IMPL block), plus shared headers and module.cpp (the Python
module). Nothing here names an op or a kernel: every expectation is read from the sources, so adding an op adds
its cases without editing this file.

No GPU is needed: this catches syntax and template errors, missing instantiations, and ptxas problems
(register spills) on a CPU-only machine. The flags matter: torch.utils.cpp_extension always adds
COMMON_NVCC_FLAGS (-D__CUDA_NO_HALF_CONVERSIONS__, -D__CUDA_NO_BFLOAT16_CONVERSIONS__, ...), which delete
the implicit __half(float) / __nv_bfloat16(float) constructors: code that plain nvcc accepts can fail the real
build. They are read from the installed torch at test time, not copied, and combined with our own flags
(angle_kernels.cuda_ops._extension.NVCC_FLAGS) as torch combines them. The kernels, and every header they
include, must not include torch, c10 or ATen headers, so only CUDA's own include path is used. Skipped when
nvcc is not installed; fails when nvcc fails.

The torch bindings (csrc/*.cpp) cannot be compiled into objects here: they need a CUDA build of torch (c10/cuda
headers are incomplete in the CPU wheel). What is checked without one: the launcher declarations at the top of
each binding (everything above `#include "binding.h"`, torch-free) are compiled with g++, and every symbol they
ask for must be defined by the nvcc-compiled kernel file, which is the undefined symbol the extension would
otherwise fail to load with. An opt-in syntax-only check of every .cpp against the CPU wheel's headers runs with
ANGLE_KERNELS_TEST_BINDING=1 (5-20 s per file on 2 cores); scripts/check_cuda_build.sh builds, links and loads
the whole extension against a CUDA torch (several GB: not in CI).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from angle_kernels import fingerprints
from angle_kernels.cuda_ops import _extension

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"
KERNEL_FILES = sorted(p.name for p in CSRC.glob("*.cu"))  # csrc/<op>.cu
BINDING_FILES = sorted(p.name for p in CSRC.glob("*.cpp"))  # csrc/<op>.cpp and module.cpp
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")  # setup.DEFAULT_ARCH_LIST
# The architectures compiled here. The sources branch on no architecture (no __CUDA_ARCH__) and no launch bound
# caps registers below what all four allow, so sm_86 and sm_89 compile the code sm_80 compiles, and each costs
# about 37 s of one core in nvcc: by default the oldest and the newest; ANGLE_KERNELS_TEST_ALL_ARCHS=1 adds the
# other two (as scripts/check_cuda_build.sh builds all four).
DEFAULT_COMPILED_ARCHS = ("sm_80", "sm_90")
COMPILED_ARCHS = ARCHS if os.environ.get("ANGLE_KERNELS_TEST_ALL_ARCHS") == "1" else DEFAULT_COMPILED_ARCHS
FORBIDDEN_INCLUDE = re.compile(r"#\s*include\s*[<\"](torch/|c10/|ATen/)")
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# A kernel: `__global__ void [__launch_bounds__(...)] name(`, qualifiers allowed before `void`.
GLOBAL_FUNCTION = re.compile(
    r"__global__\s+(?:\w+\s+)*?void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
# In a binding, the launcher declarations end where the torch part begins.
BINDING_HEADER = '#include "binding.h"'
BINDING_HEADER_LINE = re.compile(r'^\s*#\s*include\s*"binding\.h"', re.M)


def _without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)


def kernels_of(name: str) -> list[str]:
    """The __global__ functions csrc/<name> defines, read from its source."""
    return sorted(set(GLOBAL_FUNCTION.findall(_without_comments((CSRC / name).read_text()))))


def kernel_side_headers() -> list[str]:
    """Every csrc/ header a kernel file includes, directly or through another header."""
    seen: set[str] = set()
    pending = [header for name in KERNEL_FILES for header in LOCAL_INCLUDE.findall((CSRC / name).read_text())]
    while pending:
        header = pending.pop()
        if header in seen or not (CSRC / header).exists():
            continue
        seen.add(header)
        pending += LOCAL_INCLUDE.findall((CSRC / header).read_text())
    return sorted(seen)


def launcher_declarations(binding: str) -> str:
    """The top of csrc/<binding>, above `#include "binding.h"`: the launchers it calls, declared torch-free."""
    text = (CSRC / binding).read_text()
    line = BINDING_HEADER_LINE.search(text)
    assert line, (
        f"csrc/{binding} has no {BINDING_HEADER} line: a binding declares its launchers above it (torch-free) and "
        "includes the torch part below it")
    return text[: line.start()]


def _nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit or set CUDA_HOME)")


def _cuda_include() -> Path | None:
    """The CUDA toolkit's include directory (cuda_runtime_api.h), for host compiles of the bindings."""
    candidates = [Path(h) / "include" for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if h]
    if NVCC is not None:
        candidates.append(Path(NVCC).resolve().parents[1] / "include")
    candidates += [Path("/usr/local/cuda/include"), *sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)]
    return next((c for c in candidates if (c / "cuda_runtime_api.h").exists()), None)


def test_the_compile_check_covers_the_builds_architectures():
    """ARCHS are the architectures setup.py builds for by default (TORCH_CUDA_ARCH_LIST unset)."""
    built = re.search(r'^DEFAULT_ARCH_LIST = "([^"]+)"', (REPO / "setup.py").read_text(), re.MULTILINE).group(1)
    assert sorted(ARCHS) == sorted(f"sm_{arch.replace('.', '')}" for arch in built.split(";"))


def _listed(archs) -> str:
    return ", ".join(archs[:-1]) + f" and {archs[-1]}"


def test_the_readme_and_the_build_check_name_these_architectures():
    """README.md's install note names the architectures setup.py builds for, its development note those compiled here
    by default and those ANGLE_KERNELS_TEST_ALL_ARCHS=1 adds; scripts/check_cuda_build.sh builds setup.py's."""
    built = re.search(r'^DEFAULT_ARCH_LIST = "([^"]+)"', (REPO / "setup.py").read_text(), re.MULTILINE).group(1)
    assert f"TORCH_CUDA_ARCH_LIST:-{built}}}" in (REPO / "scripts" / "check_cuda_build.sh").read_text()
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"for {_listed(ARCHS)} (" in readme
    added = tuple(arch for arch in ARCHS if arch not in DEFAULT_COMPILED_ARCHS)
    assert f"for {_listed(DEFAULT_COMPILED_ARCHS)} (`ANGLE_KERNELS_TEST_ALL_ARCHS=1` adds {_listed(added)}," in readme


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_files_define_kernels(name):
    """The regex that the compile check takes its expected kernels from finds this file's kernels."""
    assert kernels_of(name), f"no __global__ function found in csrc/{name}: is the regex out of date?"


@pytest.mark.parametrize("name", [*KERNEL_FILES, *kernel_side_headers()])
def test_kernels_do_not_include_torch(name):
    text = (CSRC / name).read_text()
    bad = FORBIDDEN_INCLUDE.findall(text)
    assert not bad, f"{name} includes torch headers {bad}: kernels must compile with nvcc alone"


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_kernel_file_has_its_binding(name):
    """csrc/<op>.cu has csrc/<op>.cpp, which registers CUDA kernels and declares its launchers torch-free."""
    binding = CSRC / name.replace(".cu", ".cpp")
    assert binding.exists(), f"csrc/{name} has no binding csrc/{binding.name}"
    assert re.search(r"TORCH_LIBRARY_IMPL\(\s*angle_kernels\s*,\s*CUDA\s*,", binding.read_text()), (
        f"csrc/{binding.name} registers no CUDA kernels (TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m))")
    bad = FORBIDDEN_INCLUDE.findall(launcher_declarations(binding.name))
    assert not bad, f"csrc/{binding.name} includes torch headers {bad} above {BINDING_HEADER}"


def torch_nvcc_flags() -> list[str]:
    """What torch's extension builder passes to nvcc for a .cu file, read from the installed torch (minus the
    include paths, the -gencode list and the C++ standard, which the test sets per compile)."""
    return [*cpp_extension.COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *_extension.NVCC_FLAGS]


def test_compile_flags_include_torchs_half_conversion_switches():
    """The check below is only as strict as the real build if it sees the switches that broke it once."""
    flags = torch_nvcc_flags()
    assert "-D__CUDA_NO_HALF_CONVERSIONS__" in flags and "-D__CUDA_NO_BFLOAT16_CONVERSIONS__" in flags


# One nvcc run on a quiet machine takes 5-40 s (the sm_90 object, host code included, the longest); the limit is
# there to stop a hung compiler, not to time the compile.
NVCC_TIMEOUT_S = 900


def _cores() -> int:
    """The cores this process may run on (its affinity, which a container or CI runner may set below the count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _nvcc_run(command: list[str]) -> tuple[int, str]:
    """(returncode, combined output) of one nvcc run; a run past NVCC_TIMEOUT_S is killed and reported as failed."""
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=NVCC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"nvcc did not finish within {NVCC_TIMEOUT_S} s: {' '.join(command)}"
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile all kernel files; {name: (returncode, combined output, the sm_90 object)}.

    sm_90: a full `nvcc -c` (host and device code, so the launchers are compiled too) in C++17, the standard
    of the GPU machine's torch 2.11; the others: device code only (`-cubin`, all that differs between
    architectures, half the time) in C++20, the standard torch 2.13's builder passes.

    The runs share the process's cores, one run per core: each nvcc run is CPU-bound, so more at once finishes no
    sooner, takes the other pytest worker's core, and stretches every run (twenty at once on two busy cores ran
    past a 300 s limit); the longest runs (sm_90) start first."""
    out_dir = tmp_path_factory.mktemp("nvcc")

    def nvcc(name: str, *options: str) -> tuple[str, list[str]]:
        return name, [NVCC, *torch_nvcc_flags(), "-Xptxas", "-v", "-I", str(CSRC), str(CSRC / name), *options]

    runs = [nvcc(name, "-std=c++17", "-arch=sm_90", "-c", "-o", str(out_dir / f"{name}.sm_90.o"))
            for name in KERNEL_FILES]
    runs += [nvcc(name, "-std=c++20", f"-arch={arch}", "-cubin", "-o", str(out_dir / f"{name}.{arch}.cubin"))
             for name in KERNEL_FILES for arch in COMPILED_ARCHS if arch != "sm_90"]
    with ThreadPoolExecutor(max_workers=_cores()) as pool:
        finished = list(pool.map(_nvcc_run, [command for _, command in runs]))
    results = {}
    for name in KERNEL_FILES:
        done = [result for (file, _), result in zip(runs, finished) if file == name]
        returncode = next((code for code, _ in done if code != 0), 0)
        results[name] = (returncode, "\n".join(output for _, output in done), out_dir / f"{name}.sm_90.o")
    return results


def _ptxas_report(output: str) -> list[tuple[str, str, int, int, int]]:
    """[(arch, kernel, registers, spill store bytes, spill load bytes)] from nvcc -Xptxas -v output."""
    rows, kernel, arch, spills = [], None, None, (0, 0)
    for line in output.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            kernel, arch = m.group(1), m.group(2)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel:
            rows.append((arch, kernel, int(m.group(1)), *spills))
            kernel, spills = None, (0, 0)
    return rows


@needs_nvcc
@pytest.mark.slow  # nvcc for every file and each of COMPILED_ARCHS: 15-40 s on two cores
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvcc_compiles(compiled, name):
    """nvcc compiles the file for each of COMPILED_ARCHS, compiles every kernel its source defines (at least one
    instantiation of each: an entry function whose mangled name contains the kernel's name) for each
    architecture, and no kernel spills registers."""
    returncode, output, _ = compiled[name]
    assert returncode == 0, f"nvcc failed on csrc/{name}:\n{output}"
    report = _ptxas_report(output)
    print(f"\nptxas report for csrc/{name}:")
    for arch, kernel, regs, spill_st, spill_ld in report:
        print(f"  {arch} {regs:4d} regs  spill {spill_st}/{spill_ld} B  {kernel}")
    for arch in COMPILED_ARCHS:
        compiled_here = [kernel for a, kernel, *_ in report if a == arch]
        for expected in kernels_of(name):
            assert any(expected in k for k in compiled_here), f"{expected} was not compiled for {arch}"
    spilling = [(a, k, st, ld) for a, k, _, st, ld in report if st or ld]
    assert not spilling, f"register spills in csrc/{name}: {spilling}"


def _declared_launchers(declarations: str) -> list[tuple[str, bool]]:
    """[(name, is a template)] of the functions declared at namespace scope in a binding's declaration part."""
    code = "\n".join(line for line in _without_comments(declarations).splitlines() if not line.lstrip().startswith("#"))
    launchers = []
    for statement in re.split(r"[;{}]", code):
        statement = " ".join(statement.split())
        if "(" not in statement or not statement.endswith(")"):
            continue
        template = re.match(r"template\s*<([^>]*)>", statement)
        if template:
            assert re.fullmatch(r"\s*(typename|class)\s+\w+\s*", template.group(1)), (
                f"launcher template <{template.group(1)}>: this check handles launchers templated on the element "
                "type alone")
        launchers.append((re.search(r"(\w+)\s*\(", statement).group(1), bool(template)))
    return launchers


def _symbols(obj: Path, *nm_args: str) -> list[str]:
    proc = subprocess.run(["nm", *nm_args, str(obj)], capture_output=True, text=True, check=True)
    return [line.split(None, 2)[-1] for line in proc.stdout.splitlines() if line.strip()]


@needs_nvcc
@pytest.mark.slow  # uses the nvcc objects above
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_binding_declares_the_launchers_its_kernel_file_defines(compiled, name, tmp_path):
    """csrc/<op>.cpp declares its launchers; csrc/<op>.cu defines them without seeing those declarations. A
    declaration that differs from its definition (a parameter type, the return type of a template) asks for a
    symbol the .cu does not define: the extension would fail to load with "undefined symbol". Here: g++ compiles
    the declaration part of the binding plus a reference to every declared launcher, for every element type the
    .cu instantiates it for, and each symbol that object needs must be defined in the nvcc-compiled .cu. (An
    element type the binding dispatches to but the .cu never instantiates is not seen here: which types the
    binding calls is known only by compiling it against torch; scripts/check_cuda_build.sh sees it.)"""
    cxx = shutil.which("g++") or shutil.which("c++")
    cuda_include = _cuda_include()
    if cxx is None or cuda_include is None or shutil.which("nm") is None:
        pytest.skip("needs g++, nm and the CUDA toolkit headers (cuda_runtime_api.h)")
    returncode, output, kernel_object = compiled[name]
    assert returncode == 0, f"nvcc failed on csrc/{name} (see test_nvcc_compiles):\n{output}"
    binding = name.replace(".cu", ".cpp")
    declarations = launcher_declarations(binding)
    launchers = _declared_launchers(declarations)
    assert launchers, f"csrc/{binding} declares no launcher above {BINDING_HEADER}"
    defined_readable = _symbols(kernel_object, "--defined-only", "-C")
    references = []
    for launcher, is_template in launchers:
        if not is_template:
            references.append(f"&angle_kernels::{launcher}")
            continue
        element_types = sorted({m.group(1) for symbol in defined_readable
                                for m in [re.search(rf"\bangle_kernels::{launcher}<([\w:]+)>\(", symbol)] if m})
        assert element_types, f"csrc/{binding} declares {launcher}, which csrc/{name} does not instantiate"
        references += [f"&angle_kernels::{launcher}<{t}>" for t in element_types]
    stub = tmp_path / f"{binding}.launchers.cpp"
    stub.write_text(declarations + "\n// Every declared launcher, as the binding would call it.\n"
                    "const void* angle_kernels_launcher_references[] = {\n"
                    + "".join(f"    reinterpret_cast<const void*>({ref}),\n" for ref in references) + "};\n")
    proc = subprocess.run([cxx, "-std=c++17", "-c", f"-I{CSRC}", f"-I{cuda_include}", str(stub),
                           "-o", str(tmp_path / "stub.o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the launcher declarations of csrc/{binding} do not compile:\n{proc.stderr}"
    wanted = {s for s in _symbols(tmp_path / "stub.o", "--undefined-only") if "13angle_kernels" in s}
    assert len(wanted) == len(references), f"expected one symbol per reference, got {sorted(wanted)}"
    missing = wanted - set(_symbols(kernel_object, "--defined-only"))
    readable = subprocess.run(["c++filt"], input="\n".join(sorted(missing)), capture_output=True, text=True).stdout
    assert not missing, (
        f"csrc/{binding} declares launchers that csrc/{name} does not define (the extension would fail to load "
        f"with 'undefined symbol'): compare the declaration with the definition:\n{readable or sorted(missing)}")


@pytest.mark.skipif(os.environ.get("ANGLE_KERNELS_TEST_BINDING") != "1",
                    reason="opt-in (5-20 s per file): set ANGLE_KERNELS_TEST_BINDING=1 to syntax-check csrc/*.cpp")
@pytest.mark.parametrize("name", BINDING_FILES)
def test_binding_syntax_against_cpu_torch_headers(name):
    """Parse and type-check csrc/<name> with g++ against the installed torch's headers (no object code:
    the CPU wheel lacks c10/cuda/impl/cuda_cmake_macros.h, which C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips)."""
    torch = pytest.importorskip("torch")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or NVCC is None:
        pytest.skip("needs g++ and the CUDA toolkit headers")
    torch_include = Path(torch.__file__).parent / "include"
    cuda_include = _cuda_include()
    if cuda_include is None:
        pytest.skip("CUDA toolkit headers (cuda_runtime_api.h) not found")
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DTORCH_EXTENSION_NAME=_C",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{torch_include}", f"-I{torch_include / 'torch/csrc/api/include'}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", f"-I{CSRC}", str(CSRC / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 0, f"{name} does not compile:\n" + "\n".join(errors[:40])
    print(f"{name} syntax check passed ({sys.platform})")


def _setup_py():
    spec = importlib.util.spec_from_file_location("angle_kernels_setup_py", REPO / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # not __main__: defines the helpers, runs no setup()
    return setup_py


def test_setup_py_compiles_a_kernel_file_and_its_binding_to_different_objects(tmp_path):
    """setuptools names an object after its source minus the suffix, so csrc/<op>.cu and csrc/<op>.cpp would
    both be <op>.o (ninja: "multiple rules generate"). setup.py's build command names the .cu's <op>.cuda.o, as
    torch's JIT build does. Checked on the real source list with setuptools' compiler, which torch's
    BuildExtension uses for the object paths."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    sources = [f"csrc/{name}" for name in _extension.SOURCES]
    assert any(s.endswith(".cu") for s in sources) and any(s.endswith(".cpp") for s in sources)

    class ObjectNames(build_ext):  # stands in for torch's BuildExtension: reports the object paths, compiles nothing
        def build_extensions(self):
            self.compiler.src_extensions.append(".cu")  # as BuildExtension does
            self.objects = self.compiler.object_filenames(sources, output_dir=str(tmp_path))

    dist = Distribution({"name": "names", "ext_modules": [Extension("names", sources)]})
    command = _setup_py().cuda_objects_apart(ObjectNames)(dist)
    command.build_lib = command.build_temp = str(tmp_path)
    command.ensure_finalized()
    command.run()
    assert len(set(command.objects)) == len(sources), f"object paths collide: {command.objects}"
    for source, obj in zip(sources, command.objects):
        assert obj.endswith(".cuda.o") == source.endswith(".cu") and obj.endswith(".o"), (source, obj)


def test_setup_py_skips_an_extension_that_fails_to_compile(tmp_path, capsys):
    """setup.py wraps torch's build_ext: a compile failure installs the package without the extension (with a
    warning) unless ANGLE_KERNELS_BUILD_CUDA=1 asked for it. Exercised with a C file that does not compile,
    through setuptools' own build_ext (the wrapper works the same around torch's BuildExtension)."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    setup_py = _setup_py()
    (tmp_path / "broken.c").write_text("int broken( { return 0; }\n")

    def build(required: bool):
        dist = Distribution({"name": "broken", "ext_modules": [Extension("broken", [str(tmp_path / "broken.c")])]})
        command = setup_py.optional_build_ext(build_ext, required)(dist)
        command.build_lib = command.build_temp = str(tmp_path / "build")
        command.ensure_finalized()
        command.run()
        return command

    command = build(required=False)
    assert command.extensions == [] and not list((tmp_path / "build").rglob("broken*.so"))
    assert "WARNING: compiling broken failed" in capsys.readouterr().err
    with pytest.raises(Exception):
        build(required=True)


@pytest.mark.slow  # one compile of module.cpp (pybind11 alone): about 5 s of one core
def test_the_extension_module_reports_the_sources_it_was_built_from(tmp_path):
    """module.cpp, built with the host flags every build passes (_extension.cxx_flags), answers op_fingerprints() ==
    each op's CUDA-source fingerprint: what angle_kernels.verified matches a CUDA verification against. module.cpp
    needs no CUDA, so here it is built alone, as a CPU extension."""
    module = cpp_extension.load(name="angle_kernels_module_only", sources=[str(CSRC / "module.cpp")],
                                extra_cflags=_extension.cxx_flags(), build_directory=str(tmp_path),
                                is_python_module=True, verbose=False)
    expected = {op: int(fingerprints.csrc_fingerprint(op), 16) for op in _extension.CSRC_OPS}
    assert module.op_fingerprints() == expected


def test_every_op_with_cuda_sources_has_its_fingerprint_in_the_module():
    """module.cpp names one macro per csrc/<name>.cu, an op's or a code path's own sources (fingerprints.CSRC_SOURCES):
    one without its line would report no fingerprint and match no verification."""
    text = (CSRC / "module.cpp").read_text()
    assert _extension.CSRC_OPS == ("pair_scores", "ranking_loss", "similarity_lse", "similarity_xent",
                                   "similarity_xent_dense")
    for op in _extension.CSRC_OPS:
        assert f"{_extension.FINGERPRINT_MACRO}{op.upper()}" in text and f'{{"{op}",' in text, op
