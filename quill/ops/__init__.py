"""quill's native CPU kernels (C++ in `csrc/`, registered as `torch.library` ops) and the
PyTorch code they replace, kept as the reference and the fallback.

`library.load()` picks and loads the library this CPU runs; `build` compiles the libraries at
set-up; `fake` gives torch.compile the ops' shapes; `reference` is the PyTorch implementation;
`probe` measures the machine's read bandwidth that each kernel is judged against.
"""
