/* The tensor entries of an unpacked .szt header that keep every rule, checked and made in one C pass.
 *
 * header.py checks each entry of a header (a dict per tensor, as msgpack built it) field by field in Python: about
 * 8 us a tensor, most of a small checkpoint's header parse (MiniLM's 104 tensors: 0.85 of 1.2 ms), which no
 * thread of a load can share; making the entry objects in Python from fields checked here still cost 4 us. This
 * pass checks the same rules on the entries that need nothing more and makes their objects:
 *
 *   plain_entries(tensors, rules, records) -> [entry or None, ...]
 *       Per item of the list ``tensors``, its TensorEntry, or None where the item is not plain: an at-rest stage,
 *       an encoding or a form these checks do not take, or any rule broken. header.py then parses that item itself
 *       and words the error where there is one; so this module never has to, a None costs only speed, and the
 *       Python parser stays the reference every entry made here is tested against, field for field
 *       (tests/format/test_plain_entries.py).
 *
 *   rules: (itemsize, max_name_bytes, reserved_name, max_ndim, max_elements, chunk_size, max_splitzip_elements,
 *   min_block_size, max_block_size), ``itemsize`` the dict of dtype names to bytes per element: format/constants.py's
 *   values, handed over so that none is written twice.
 *
 *   records: (TensorEntry, its defaults, Codebook, BlockChecksums, payload_layout): the classes are made as
 *   header._entry makes a TensorEntry (``object.__new__`` and the fields set in the instance's dict, the generated
 *   ``__init__`` skipped: its checks are the ones made here), the layout by calling payload_layout(n, n_esc).
 *   Strings and integers are the header's own objects; shape and the codebook are tuples.
 *
 * The rules, as header._parse_entry applies them: a str name of 1 to max_name_bytes UTF-8 bytes, without NUL, not
 * the reserved name; a known dtype; a list of at most max_ndim integers in [0, max_elements] whose product is at
 * most max_elements; offset, length and raw_length integers >= 0, the CRC-32s in [0, 2**32); raw_length the shape's
 * bytes; an optional block_crc32 map of a power-of-two size in [min, max] and one CRC-32 per block of the stored
 * bytes. Raw: stored bytes that are the raw ones (same length, same CRC-32), an optional str reason. SplitZip (BF16
 * only): chunk_size the format's, n the shape's elements, n_esc <= n, n at most max_splitzip_elements, the stored
 * length and stream offsets those of the frozen payload layout, sixteen codebook bytes of which the first
 * n_codes_used are distinct and the rest 0, a float coverage in [0, 1]. An integer is an int, never a bool.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define N_CODES 16

typedef struct {
    PyObject *itemsize;
    Py_ssize_t max_name_bytes;
    PyObject *reserved_name;
    Py_ssize_t max_ndim;
    int64_t max_elements, chunk_size, max_splitzip_elements, min_block, max_block;
} Rules;

enum { K_NAME, K_DTYPE, K_SHAPE, K_OFFSET, K_LENGTH, K_RAW_LENGTH, K_CRC32, K_RAW_CRC32, K_ENCODING, K_BLOCKS,
       K_AT_REST, K_CONFIGURATION, K_REASON, K_CHUNK_SIZE, K_N, K_N_ESC, K_STREAMS, K_CODEBOOK, K_N_USED,
       K_COVERAGE, K_SIZE, K_PK, K_SM, K_CHUNK_ID, K_LOCAL_POS, K_ESC_VAL, K_RAW, K_SPLITZIP, K_BF16,
       /* the records' field names */
       F_BLOCKS, F_CRCS, F_LAYOUT, F_RAW_REASON, F_DEC_LUT, F_N_USED, N_KEYS };
static const char *const key_text[N_KEYS] = {
    "name", "dtype", "shape", "offset", "length", "raw_length", "crc32", "raw_crc32", "encoding", "block_crc32",
    "at_rest", "configuration", "reason", "chunk_size", "n", "n_esc", "streams", "codebook", "n_codes_used",
    "coverage", "size", "pk", "sm", "chunk_id", "local_pos", "esc_val", "raw", "splitzip", "BF16",
    "blocks", "crcs", "layout", "raw_reason", "dec_lut", "n_used"};
static PyObject *keys[N_KEYS]; /* interned at import */

/* ``map[key]`` (borrowed), or NULL where it is absent; never an error set (the keys are str, the maps dicts). */
static PyObject *get(PyObject *map, int key)
{
    PyObject *value = PyDict_GetItemWithError(map, keys[key]);
    if (value == NULL)
        PyErr_Clear();
    return value;
}

/* 0 where ``value`` is an int (not a bool) in [lo, hi], stored in *out; -1 otherwise, no error set. */
static int int_in(PyObject *value, int64_t lo, int64_t hi, int64_t *out)
{
    if (value == NULL || !PyLong_CheckExact(value))
        return -1;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    if (x < lo || x > hi)
        return -1;
    *out = x;
    return 0;
}

static int is_str(PyObject *value, int key)
{
    return value != NULL && PyUnicode_CheckExact(value) && PyUnicode_Compare(value, keys[key]) == 0;
}

static int plain_name(PyObject *name, const Rules *r)
{
    if (name == NULL || !PyUnicode_CheckExact(name))
        return -1;
    Py_ssize_t size;
    const char *text = PyUnicode_AsUTF8AndSize(name, &size);
    if (text == NULL) { /* a lone surrogate */
        PyErr_Clear();
        return -1;
    }
    if (size == 0 || size > r->max_name_bytes || memchr(text, 0, (size_t)size) != NULL)
        return -1;
    return PyUnicode_Compare(name, r->reserved_name) == 0 ? -1 : 0;
}

/* The shape as a new tuple and its element count; NULL with no error set where it breaks a rule, NULL with an
 * error set where the tuple could not be made. */
static PyObject *plain_shape(PyObject *shape, const Rules *r, int64_t *numel)
{
    if (shape == NULL || !PyList_CheckExact(shape) || PyList_GET_SIZE(shape) > r->max_ndim)
        return NULL;
    int64_t product = 1;
    int zero = 0, over = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(shape); i++) {
        int64_t d;
        if (int_in(PyList_GET_ITEM(shape, i), 0, r->max_elements, &d) < 0)
            return NULL;
        if (d == 0)
            zero = 1;
        else if (product > r->max_elements / d)
            over = 1;
        else
            product *= d;
    }
    if (!zero && over)
        return NULL;
    *numel = zero ? 0 : product;
    return PyList_AsTuple(shape);
}

/* Each of ``list``'s ``count`` items an int in [lo, hi], as a new tuple; NULL as plain_shape. */
static PyObject *int_tuple(PyObject *list, Py_ssize_t count, int64_t lo, int64_t hi)
{
    if (list == NULL || !PyList_CheckExact(list) || PyList_GET_SIZE(list) != count)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t unused;
        if (int_in(PyList_GET_ITEM(list, i), lo, hi, &unused) < 0)
            return NULL;
    }
    return PyList_AsTuple(list);
}

typedef struct {
    PyObject *entry, *entry_defaults, *codebook, *blocks, *layout;
} Records;

static PyObject *no_args; /* () */

/* An instance of the class ``cls`` holding ``fields`` (a dict, a new reference, taken over), made as header._entry
 * makes a TensorEntry: its instance dict updated with them. (Replacing the dict with PyObject_GenericSetDict instead
 * leaves an instance without its fields on Python 3.13, whose instances keep their attributes inline until their
 * dict is asked for.) NULL with an error set where it could not be made. */
static PyObject *record(PyObject *cls, PyObject *fields)
{
    if (fields == NULL)
        return NULL;
    PyObject *made = PyBaseObject_Type.tp_new((PyTypeObject *)cls, no_args, NULL);
    PyObject *dict = made == NULL ? NULL : PyObject_GenericGetDict(made, NULL);
    if (dict == NULL || PyDict_Update(dict, fields) < 0)
        Py_CLEAR(made);
    Py_XDECREF(dict);
    Py_DECREF(fields);
    return made;
}

/* Sets ``count`` items of the dict ``fields``, the names' keys to the borrowed ``values``: 0, or -1 with an error
 * set. */
static int set_items(PyObject *fields, int count, const int *names, PyObject *const *values)
{
    for (int i = 0; i < count; i++)
        if (PyDict_SetItem(fields, keys[names[i]], values[i]) < 0)
            return -1;
    return 0;
}

/* An instance of ``cls`` holding ``count`` fields (set_items); NULL with an error set where it could not be made. */
static PyObject *new_record(PyObject *cls, int count, const int *names, PyObject *const *values)
{
    PyObject *fields = PyDict_New();
    if (fields != NULL && set_items(fields, count, names, values) < 0)
        Py_CLEAR(fields);
    return record(cls, fields);
}

/* 1.3's block_crc32: Py_None where the entry has none, its BlockChecksums where it keeps the rules, NULL otherwise
 * (an error set only where the record could not be made). */
static PyObject *plain_blocks(PyObject *item, int64_t length, const Rules *r, const Records *m)
{
    PyObject *blocks = get(item, K_BLOCKS);
    if (blocks == NULL)
        return Py_NewRef(Py_None);
    int64_t size;
    if (!PyDict_CheckExact(blocks) || int_in(get(blocks, K_SIZE), r->min_block, r->max_block, &size) < 0
        || (size & (size - 1)))
        return NULL;
    PyObject *crcs = int_tuple(get(blocks, K_CRC32), (Py_ssize_t)(length / size + (length % size != 0)), 0,
                               0xFFFFFFFFll);
    if (crcs == NULL)
        return NULL;
    const int names[2] = {K_SIZE, F_CRCS};
    PyObject *values[2] = {get(blocks, K_SIZE), crcs};
    PyObject *made = new_record(m->blocks, 2, names, values);
    Py_DECREF(crcs);
    return made;
}

static int64_t align4(int64_t x) { return (x + 3) & ~(int64_t)3; }

/* The layout and codebook of an entry of ``numel`` BF16 elements and ``length`` stored bytes, set in ``fields``:
 * 0; -1 where the configuration breaks a rule (no error set) or a record could not be made (an error set). */
static int plain_splitzip(PyObject *config, int64_t numel, int64_t length, const Rules *r, const Records *m,
                          PyObject *fields)
{
    int64_t chunk_size, n, n_esc, n_used;
    if (config == NULL || int_in(get(config, K_CHUNK_SIZE), 1, 65536, &chunk_size) < 0 || chunk_size != r->chunk_size
        || int_in(get(config, K_N), 0, INT64_MAX, &n) < 0 || int_in(get(config, K_N_ESC), 0, INT64_MAX, &n_esc) < 0
        || n != numel || n_esc > n || n > r->max_splitzip_elements)
        return -1;
    /* The frozen payload layout (codec/layout.py): pk, sm, chunk ids, local positions, escape values. */
    int64_t off_sm = align4((n + 1) / 2), off_cid = align4(off_sm + n), off_lpos = off_cid + 4 * n_esc;
    int64_t off_ev = align4(off_lpos + 2 * n_esc);
    if (length != off_ev + n_esc)
        return -1;
    PyObject *streams = get(config, K_STREAMS);
    const int stream_keys[5] = {K_PK, K_SM, K_CHUNK_ID, K_LOCAL_POS, K_ESC_VAL};
    const int64_t offsets[5] = {0, off_sm, off_cid, off_lpos, off_ev};
    if (streams == NULL || !PyDict_CheckExact(streams) || PyDict_GET_SIZE(streams) != 5)
        return -1;
    for (int i = 0; i < 5; i++) {
        int64_t offset;
        if (int_in(get(streams, stream_keys[i]), 0, INT64_MAX, &offset) < 0 || offset != offsets[i])
            return -1;
    }
    PyObject *coverage = get(config, K_COVERAGE);
    if (int_in(get(config, K_N_USED), 0, N_CODES, &n_used) < 0 || coverage == NULL || !PyFloat_CheckExact(coverage)
        || !(PyFloat_AS_DOUBLE(coverage) >= 0.0 && PyFloat_AS_DOUBLE(coverage) <= 1.0))
        return -1;
    PyObject *lut = int_tuple(get(config, K_CODEBOOK), N_CODES, 0, 255);
    if (lut == NULL)
        return -1;
    uint8_t seen[256] = {0};
    for (Py_ssize_t i = 0; i < N_CODES; i++) {
        long exponent = PyLong_AsLong(PyTuple_GET_ITEM(lut, i)); /* in [0, 255]: checked above */
        if (i < n_used ? seen[exponent]++ != 0 : exponent != 0) {
            Py_DECREF(lut);
            return -1;
        }
    }
    const int book_names[3] = {F_DEC_LUT, F_N_USED, K_COVERAGE};
    PyObject *book_values[3] = {lut, get(config, K_N_USED), coverage};
    PyObject *codebook = new_record(m->codebook, 3, book_names, book_values);
    Py_DECREF(lut);
    PyObject *layout = codebook == NULL ? NULL : PyObject_CallFunctionObjArgs(m->layout, get(config, K_N),
                                                                              get(config, K_N_ESC), NULL);
    const int names[3] = {K_ENCODING, F_LAYOUT, K_CODEBOOK};
    PyObject *values[3] = {keys[K_SPLITZIP], layout, codebook};
    int failed = layout == NULL || set_items(fields, 3, names, values) < 0;
    Py_XDECREF(codebook);
    Py_XDECREF(layout);
    return failed ? -1 : 0;
}

/* The encoding of an entry, set in ``fields`` (its name, then a raw entry's reason or plain_splitzip's): 0, or -1
 * as plain_splitzip. */
static int plain_encoding(PyObject *item, PyObject *dtype, int64_t numel, int64_t length, int64_t raw_length,
                          int64_t crc, int64_t raw_crc, const Rules *r, const Records *m, PyObject *fields)
{
    PyObject *encoding = get(item, K_ENCODING);
    if (encoding == NULL || !PyDict_CheckExact(encoding) || get(encoding, K_AT_REST) != NULL)
        return -1;
    PyObject *name = get(encoding, K_NAME), *config = get(encoding, K_CONFIGURATION);
    if (config != NULL && !PyDict_CheckExact(config))
        return -1;
    if (is_str(name, K_RAW)) {
        PyObject *reason = config == NULL ? NULL : get(config, K_REASON);
        if (length != raw_length || crc != raw_crc || (reason != NULL && !PyUnicode_CheckExact(reason)))
            return -1;
        const int names[2] = {K_ENCODING, F_RAW_REASON};
        PyObject *values[2] = {keys[K_RAW], reason == NULL ? Py_None : reason};
        return set_items(fields, 2, names, values);
    }
    if (is_str(name, K_SPLITZIP) && is_str(dtype, K_BF16))
        return plain_splitzip(config, numel, length, r, m, fields);
    return -1;
}

/* One item's TensorEntry (plain_entries), Py_None where it is not plain, NULL with an error set on a failed
 * allocation. */
static PyObject *plain_entry(PyObject *item, const Rules *r, const Records *m)
{
    if (!PyDict_CheckExact(item))
        return Py_NewRef(Py_None);
    PyObject *name = get(item, K_NAME), *dtype = get(item, K_DTYPE), *size;
    int64_t itemsize, numel, offset, length, raw_length, crc, raw_crc;
    if (plain_name(name, r) < 0 || dtype == NULL || !PyUnicode_CheckExact(dtype)
        || (size = PyDict_GetItemWithError(r->itemsize, dtype)) == NULL || int_in(size, 1, 64, &itemsize) < 0) {
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    PyObject *shape = plain_shape(get(item, K_SHAPE), r, &numel), *blocks = NULL, *fields = NULL;
    if (shape == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    if (int_in(get(item, K_OFFSET), 0, INT64_MAX, &offset) == 0
        && int_in(get(item, K_LENGTH), 0, INT64_MAX, &length) == 0
        && int_in(get(item, K_RAW_LENGTH), 0, INT64_MAX, &raw_length) == 0
        && int_in(get(item, K_CRC32), 0, 0xFFFFFFFFll, &crc) == 0
        && int_in(get(item, K_RAW_CRC32), 0, 0xFFFFFFFFll, &raw_crc) == 0 && raw_length == numel * itemsize
        && (blocks = plain_blocks(item, length, r, m)) != NULL) {
        const int names[9] = {K_NAME, K_DTYPE, K_SHAPE, K_OFFSET, K_LENGTH, K_RAW_LENGTH, K_CRC32, K_RAW_CRC32,
                               F_BLOCKS};
        PyObject *values[9] = {name, dtype, shape, get(item, K_OFFSET), get(item, K_LENGTH),
                               get(item, K_RAW_LENGTH), get(item, K_CRC32), get(item, K_RAW_CRC32), blocks};
        fields = PyDict_Copy(m->entry_defaults);
        if (fields != NULL && (set_items(fields, 9, names, values) < 0
                               || plain_encoding(item, dtype, numel, length, raw_length, crc, raw_crc, r, m,
                                                 fields) < 0))
            Py_CLEAR(fields);
    }
    Py_DECREF(shape);
    Py_XDECREF(blocks);
    if (fields == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return record(m->entry, fields);
}

static int take_rules(PyObject *rules, Rules *r)
{
    if (!PyTuple_Check(rules) || PyTuple_GET_SIZE(rules) != 9) {
        PyErr_SetString(PyExc_TypeError, "plain_entries(): rules must be a tuple of 9");
        return -1;
    }
    PyObject *const *v = &PyTuple_GET_ITEM(rules, 0);
    long long numbers[7];
    const int at[7] = {1, 3, 4, 5, 6, 7, 8};
    for (int i = 0; i < 7; i++) {
        numbers[i] = PyLong_AsLongLong(v[at[i]]);
        if (numbers[i] == -1 && PyErr_Occurred())
            return -1;
        if (numbers[i] < 1) {
            PyErr_SetString(PyExc_ValueError, "plain_entries(): the rules' numbers must be positive");
            return -1;
        }
    }
    if (!PyDict_CheckExact(v[0]) || !PyUnicode_CheckExact(v[2])) {
        PyErr_SetString(PyExc_TypeError, "plain_entries(): rules hold an itemsize dict and a reserved name str");
        return -1;
    }
    *r = (Rules){v[0], (Py_ssize_t)numbers[0], v[2], (Py_ssize_t)numbers[1], numbers[2], numbers[3], numbers[4],
                 numbers[5], numbers[6]};
    return 0;
}

static int take_records(PyObject *records, Records *m)
{
    if (!PyTuple_Check(records) || PyTuple_GET_SIZE(records) != 5) {
        PyErr_SetString(PyExc_TypeError, "plain_entries(): records must be a tuple of 5");
        return -1;
    }
    PyObject *const *v = &PyTuple_GET_ITEM(records, 0);
    if (!PyType_Check(v[0]) || !PyDict_CheckExact(v[1]) || !PyType_Check(v[2]) || !PyType_Check(v[3])
        || !PyCallable_Check(v[4])) {
        PyErr_SetString(PyExc_TypeError, "plain_entries(): records are the entry class, its defaults (a dict), the "
                                         "codebook and block-checksum classes and the layout maker");
        return -1;
    }
    *m = (Records){v[0], v[1], v[2], v[3], v[4]};
    return 0;
}

static PyObject *py_plain_entries(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Rules r;
    Records m;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "plain_entries() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "plain_entries(): tensors must be a list");
        return NULL;
    }
    if (take_rules(args[1], &r) < 0 || take_records(args[2], &m) < 0)
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(args[0]);
    PyObject *result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *entry = plain_entry(PyList_GET_ITEM(args[0], i), &r, &m);
        if (entry == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, entry);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"plain_entries", (PyCFunction)(void (*)(void))py_plain_entries, METH_FASTCALL,
     "plain_entries(tensors, rules, records) -> [entry or None, ...]: the TensorEntry of each header item that keeps "
     "every rule; None for any other (parse it in Python)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_entries",
                                    "Plain tensor entries of a .szt header, checked and made in C.", -1, methods};

PyMODINIT_FUNC PyInit__entries(void)
{
    if ((no_args = PyTuple_New(0)) == NULL)
        return NULL;
    for (int i = 0; i < N_KEYS; i++)
        if ((keys[i] = PyUnicode_InternFromString(key_text[i])) == NULL)
            return NULL;
    return PyModule_Create(&module);
}
