/* One pass over DGRD Mode 2 entries: the checks of bridge/mode2_check.py's gathered numpy passes, fused.
 *
 * mode2_scan(body, starts, counts, sums) -> bool
 *   body    the packet's bytes (any contiguous buffer)
 *   starts  int64[n]: byte offset in body of each Mode 2 section's entries
 *   counts  int64[n]: entries (nnz) of each section; entry k of a section is (u8 skip, f16 value) at start + 3k
 *   sums    int64[n], written: the sum of each section's skips
 * Returns False as soon as a value is not finite (its five exponent bits all ones), True otherwise. Raises
 * ValueError if a section lies outside body or the arrays disagree in length. The loop runs without the GIL.
 * Only speed is at stake: bridge/mode2_check.py does the same with numpy when this module is not built, and tests
 * hold the two to the same answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int scan(const uint8_t *body, const int64_t *starts, const int64_t *counts, int64_t *sums, Py_ssize_t n) {
    for (Py_ssize_t s = 0; s < n; s++) {
        const uint8_t *p = body + starts[s];
        const int64_t count = counts[s];
        uint64_t sum = 0;
        uint8_t not_finite = 0;
        for (int64_t k = 0; k < count; k++, p += 3) {
            sum += p[0];
            not_finite |= (uint8_t)((p[2] & 0x7C) == 0x7C);
        }
        if (not_finite)
            return 0;
        sums[s] = (int64_t)sum;
    }
    return 1;
}

static PyObject *mode2_scan(PyObject *self, PyObject *args) {
    Py_buffer body, starts, counts, sums;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &body, &starts, &counts, &sums))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    if (starts.len % sizeof(int64_t) || counts.len != starts.len || sums.len != starts.len) {
        PyErr_SetString(PyExc_ValueError, "starts, counts and sums must be int64 arrays of one length");
        goto done;
    }
    const int64_t *st = starts.buf, *ct = counts.buf;
    for (Py_ssize_t s = 0; s < n; s++) {
        if (st[s] < 0 || ct[s] < 0 || ct[s] > (body.len - st[s]) / 3 || st[s] > body.len) {
            PyErr_Format(PyExc_ValueError, "section %zd (start %lld, %lld entries) is outside the %zd-byte body",
                         s, (long long)st[s], (long long)ct[s], body.len);
            goto done;
        }
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = scan(body.buf, st, ct, sums.buf, n);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&body);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&sums);
    return result;
}

static PyMethodDef methods[] = {
    {"mode2_scan", mode2_scan, METH_VARARGS,
     "mode2_scan(body, starts, counts, sums) -> bool: skip sums per section into sums; False if a value is not finite"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dgrd_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__dgrd_native(void) { return PyModule_Create(&module); }
