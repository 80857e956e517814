// The Python module object for treadle._C. Kernels register themselves with the PyTorch
// dispatcher (TORCH_LIBRARY_FRAGMENT(treadle_C, ...)) from static initialisers in their own
// files, so importing this module is all it takes to make torch.ops.treadle_C.* available.
#include <Python.h>

static struct PyModuleDef treadle_c_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "treadle compiled kernels (registered as torch.ops.treadle_C.*)", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&treadle_c_module); }
