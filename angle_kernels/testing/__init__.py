"""The oracle and helpers of the project's tests and benchmarks (like torch.testing): not part of the loss API.

    oracle       the float64 oracle: literal N x N transcriptions of every op and every public loss; imports
                 nothing but torch and angle_kernels.float64_ops (no pytest), so the benchmarks use it too
    helpers      seeds and inputs, the backends under test, running a function and its backward, and the checks
                 against the oracle (the tolerances, the half-precision rule); needs hypothesis, and pytest in the
                 helpers that skip a case (imported there)
    cases        the loss cases that the Matryoshka and layer-wise tests share
    tiny_model   a tiny BERT sentence encoder built offline, for the integration tests
    triton_interpreter
                 the Triton interpreter without its repatching of triton.language at every helper call inside a
                 kernel (the root conftest.py switches it on: the interpreted tests' speed, no value changed)

Nothing here is imported by `import angle_kernels`.
"""
