// The extension's METH_FASTCALL functions: per-layer calls from Python that skip pybind11, whose
// argument conversion and overload dispatch cost several µs a call, and tens between a forward's
// layers (cold caches), against about 1 µs for a CPython fast call.
//
// plan_entry: the compiled planner's per-layer entry (moelab/hybrid/_entry.py): one call from the
// hybrid runtime's plan handler to the numba-compiled planner, with the layer's routing passed as
// the model's own tensors. The numba dispatcher's boxing of ten arguments (numpy views made of
// the tensors first) cost 35 µs a layer on the development VM. This function reads each tensor's
// data pointer and shape, writes them into the word block the numba entry (a cfunc:
// moelab.hybrid._entry.entry_addresses) reads, and calls it; the planner's state lives in the
// handle (moelab.hybrid._compiled.handle) the caller passes by address. Anything it does not take
// as is — a tensor of another dtype or device, non-contiguous, of the wrong rank, or a plan larger
// than the planner's buffers — returns None before anything changed, and the caller plans through
// the numba dispatcher path (which converts, grows and checks).
//
// params_key: what a prepared kernels call depends on (moelab.kernels.backend: each parameter's
// data pointer, version, dtype and shape) as one bytes object, read in C++ rather than through
// four Python getters per parameter.
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moelab {

// The words of params_key: per tensor of the sequence ``params`` (None entries and repeats
// skipped), its data pointer, version counter, dtype and shape, as int64 words in a bytes object
// (a new reference; nullptr with a Python error set for a bad sequence).
PyObject* params_key_of(PyObject* params) {
  HANDLE_TH_ERRORS
  PyObject* seq = PySequence_Fast(params, "params_key: expected a sequence of tensors");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<int64_t> words;
  words.reserve(8 * n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = items[i];
    if (o == Py_None || std::find(items, items + i, o) != items + i) continue;
    if (!THPVariable_Check(o)) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_TypeError, "params_key: item %zd is a %s, expected a tensor or None", i, Py_TYPE(o)->tp_name);
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(o);
    words.push_back(reinterpret_cast<int64_t>(t.defined() ? t.data_ptr() : nullptr));
    // (an inference tensor has no version counter: it cannot be modified in place outside
    // inference mode, so its pointer, dtype and shape are its key)
    words.push_back(t.defined() && !t.is_inference() ? static_cast<int64_t>(t._version()) : -1);
    words.push_back(t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1);
    words.push_back(t.defined() ? t.dim() : -1);
    if (t.defined())
      for (int64_t d : t.sizes()) words.push_back(d);
  }
  Py_DECREF(seq);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                   static_cast<Py_ssize_t>(words.size() * sizeof(int64_t)));
  END_HANDLE_TH_ERRORS
}

namespace {

// word layout of the block the numba entry reads (keep in step with moelab/hybrid/_entry.py)
enum : int {
  W_HANDLE, W_HANDLE_LEN, W_LAYER, W_MODE, W_PF_TARGET, W_BUDGET,
  W_IDS, W_IDS_T, W_IDS_K, W_W, W_W_T, W_W_K, W_ST, W_ST_T, W_ST_K,
  W_SC, W_SC_R, W_SC_E, W_PF, W_PF_N,
  W_RESULT,  // then: record length, error, skipped, moved, immediate width, deferred width, record address
  W_WORDS = W_RESULT + 7,
};

enum Kind { I64, F32, U16, I8 };

using entry_fn = int64_t (*)(int64_t*);

float zero_f32 = 0.f;
int8_t zero_i8 = 0;
int64_t zero_i64 = 0;

// A tensor's (or, for a numpy array, a buffer's) data pointer and shape into w[0..dims]; false
// where it is not a C-contiguous CPU array of that kind and rank. bf16 tensors are read as U16
// (their bit patterns).
bool view(PyObject* o, Kind kind, int dims, int64_t* w, bool writable = false) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    const auto st = t.scalar_type();
    const bool ok = kind == I64 ? st == at::kLong : kind == F32 ? st == at::kFloat
                  : kind == U16 ? st == at::kBFloat16 : st == at::kChar;
    if (!ok || t.dim() != dims || !t.device().is_cpu() || !t.is_contiguous()) return false;
    w[0] = reinterpret_cast<int64_t>(t.data_ptr());
    for (int d = 0; d < dims; ++d) w[1 + d] = t.size(d);
    return true;
  }
  if (!PyObject_CheckBuffer(o)) return false;
  Py_buffer b;
  if (PyObject_GetBuffer(o, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0) {
    PyErr_Clear();
    return false;
  }
  const char f = b.format ? b.format[b.format[0] == '<' || b.format[0] == '=' || b.format[0] == '@'] : 'B';
  const bool ok = b.ndim == dims && (kind == I64 ? b.itemsize == 8 && (f == 'q' || f == 'l')
                                    : kind == F32 ? b.itemsize == 4 && f == 'f'
                                    : kind == I8 ? b.itemsize == 1 && f == 'b' : false);
  if (ok) {
    w[0] = reinterpret_cast<int64_t>(b.buf);
    for (int d = 0; d < dims; ++d) w[1 + d] = b.shape[d];
  }
  PyBuffer_Release(&b);  // the caller holds the object for the call
  return ok;
}

bool as_int(PyObject* o, int64_t* v) {
  *v = PyLong_AsLongLong(o);
  if (*v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// plan_entry(fn_f32, fn_u16, handle, handle_len, tables, slots, layers, layer, mode, pf_target, budget,
//            ids, weights, state, scores, prefetch) -> (record (a list of ints), error, skipped, moved,
//            immediate width, deferred width, tokens) or None (plan through the dispatcher path)
PyObject* plan_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 16) {
    PyErr_SetString(PyExc_TypeError, "plan_entry takes 16 positional arguments");
    return nullptr;
  }
  int64_t fn32, fn16, tables, slots, layers, blk[W_WORDS];
  if (!as_int(args[0], &fn32) || !as_int(args[1], &fn16) || !as_int(args[2], &blk[W_HANDLE]) ||
      !as_int(args[3], &blk[W_HANDLE_LEN]) || !as_int(args[4], &tables) || !as_int(args[5], &slots) ||
      !as_int(args[6], &layers) || !as_int(args[7], &blk[W_LAYER]) || !as_int(args[8], &blk[W_MODE]) ||
      !as_int(args[9], &blk[W_PF_TARGET]) || !as_int(args[10], &blk[W_BUDGET]))
    Py_RETURN_NONE;
  if (blk[W_LAYER] < 0 || blk[W_LAYER] >= layers || !view(args[11], I64, 2, &blk[W_IDS])) Py_RETURN_NONE;
  const int64_t T = blk[W_IDS_T], K = blk[W_IDS_K];
  int64_t fn = fn32;
  // as the dispatcher path: the weights are read for several tokens or a deferral (they order a
  // union, rank the slots to defer, and compact the routing), else a (1, 1) zero stands in
  const bool weights = T > 1 || blk[W_MODE] == 2;
  if (!weights || args[12] == Py_None) {
    if (weights) Py_RETURN_NONE;
    blk[W_W] = reinterpret_cast<int64_t>(&zero_f32), blk[W_W_T] = 1, blk[W_W_K] = 1;
  } else if (!view(args[12], F32, 2, &blk[W_W])) {
    if (!view(args[12], U16, 2, &blk[W_W])) Py_RETURN_NONE;
    fn = fn16;
  }
  if (weights && (blk[W_W_T] != T || blk[W_W_K] != K)) Py_RETURN_NONE;
  if (args[13] == Py_None) {
    blk[W_ST] = reinterpret_cast<int64_t>(&zero_i8), blk[W_ST_T] = 1, blk[W_ST_K] = 1;
  } else if (!view(args[13], I8, 2, &blk[W_ST], blk[W_MODE] == 2) || blk[W_ST_T] != T || blk[W_ST_K] != K) {
    Py_RETURN_NONE;
  }
  if (args[14] == Py_None) {
    blk[W_SC] = reinterpret_cast<int64_t>(&zero_f32), blk[W_SC_R] = 1, blk[W_SC_E] = 1;
  } else if (!view(args[14], F32, 2, &blk[W_SC])) {
    Py_RETURN_NONE;
  }
  if (args[15] == Py_None) {
    blk[W_PF] = reinterpret_cast<int64_t>(&zero_i64), blk[W_PF_N] = 0;
  } else if (!view(args[15], I64, 1, &blk[W_PF])) {
    Py_RETURN_NONE;
  }
  const int64_t rows = T > blk[W_SC_R] ? T : blk[W_SC_R];
  if (rows >= tables || T * K > slots || fn == 0) Py_RETURN_NONE;  // the dispatcher path grows the buffers
  for (int i = W_RESULT; i < W_WORDS; ++i) blk[i] = 0;
  // the entry returns 1 once it wrote its results (a numba cfunc reports an exception it caught
  // only by not getting there)
  if (reinterpret_cast<entry_fn>(fn)(blk) != 1 || blk[W_RESULT + 6] == 0) {
    PyErr_SetString(PyExc_RuntimeError, "moelab: the compiled planner's native entry failed (its message, if any, "
                                        "is on stderr); set MOELAB_PLANNER_ENTRY=numba to plan through the dispatcher");
    return nullptr;
  }
  const int64_t* r = blk + W_RESULT;
  // the record as a list of ints (what a lazy plan decodes and the simulator's columns read)
  const int64_t* rec = reinterpret_cast<const int64_t*>(r[6]);
  PyObject* list = PyList_New(r[0]);
  if (list == nullptr) return nullptr;
  for (int64_t i = 0; i < r[0]; ++i) {
    PyObject* v = PyLong_FromLongLong(rec[i]);
    if (v == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, v);
  }
  return Py_BuildValue("(NLLLLLL)", list, static_cast<long long>(r[1]), static_cast<long long>(r[2]),
                       static_cast<long long>(r[3]), static_cast<long long>(r[4]), static_cast<long long>(r[5]),
                       static_cast<long long>(T));
  END_HANDLE_TH_ERRORS
}

PyObject* params_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) {
    PyErr_SetString(PyExc_TypeError, "params_key takes one sequence of tensors");
    return nullptr;
  }
  return params_key_of(args[0]);
}

PyMethodDef methods[] = {
    {"plan_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plan_entry)), METH_FASTCALL,
     "the compiled planner's per-layer entry (moelab.hybrid._entry): None where it cannot take the call"},
    {"params_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(params_key)), METH_FASTCALL,
     "what a prepared kernels call depends on: each tensor's data pointer, version, dtype and shape (bytes)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void register_fastcalls(PyObject* module) { PyModule_AddFunctions(module, methods); }

}  // namespace moelab
