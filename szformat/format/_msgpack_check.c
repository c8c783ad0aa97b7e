/* Whether a .szt header can be handed to msgpack's plain C unpacker, in one pass over its bytes.
 *
 * The header's rules that msgpack itself does not enforce (map keys are strings and none appears twice in a map;
 * the number of maps and arrays bounded by the header's size, so a flood of empty containers is refused before it
 * costs memory; a bounded nesting depth) are otherwise checked by Python hooks that msgpack calls once per map and
 * array: on a typical header about four times msgpack's own time. This pass checks the same rules without building
 * anything:
 *
 *   plain(raw, max_depth, max_containers) -> bool
 *       True when ``raw`` is exactly one well-formed msgpack object whose maps have only str keys, none twice,
 *       whose maps and arrays nest at most ``max_depth`` deep (the top one counted) and number at most
 *       ``max_containers``. False otherwise: the caller then parses with its hooks, which say what is wrong, so
 *       this module never has to word an error and a False costs only speed.
 *
 * Keys are compared as their encoded bytes: a str key's bytes are its UTF-8 text, so two keys are the same string
 * exactly when their payloads are equal (an invalid UTF-8 key is refused by the unpacker either way). The recursion
 * is bounded by ``max_depth``, and a container's element count by the bytes left, so no input makes this loop or
 * allocate beyond the header's size.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *data;
    Py_ssize_t length, at, containers, max_containers;
    int max_depth;
} Scan;

typedef struct {
    const uint8_t *bytes;
    Py_ssize_t length;
} Key;

/* The next ``width``-byte big-endian unsigned integer, or -1 when the header ends first. */
static int64_t take_uint(Scan *s, int width)
{
    if (s->length - s->at < width)
        return -1;
    uint64_t value = 0;
    for (int i = 0; i < width; i++)
        value = value << 8 | s->data[s->at + i];
    s->at += width;
    return value > (uint64_t)PY_SSIZE_T_MAX ? -1 : (int64_t)value;
}

/* Skip ``count`` bytes; 0 when the header holds them. */
static int skip(Scan *s, int64_t count)
{
    if (count < 0 || s->length - s->at < count)
        return -1;
    s->at += (Py_ssize_t)count;
    return 0;
}

static int key_order(const void *a, const void *b)
{
    const Key *x = a, *y = b;
    if (x->length != y->length)
        return x->length < y->length ? -1 : 1;
    return memcmp(x->bytes, y->bytes, (size_t)x->length);
}

/* Whether two of ``count`` keys are equal: pairwise for the few keys of a tensor entry, sorted otherwise. */
static int any_twice(Key *keys, Py_ssize_t count)
{
    if (count <= 16) {
        for (Py_ssize_t i = 0; i < count; i++)
            for (Py_ssize_t j = i + 1; j < count; j++)
                if (key_order(&keys[i], &keys[j]) == 0)
                    return 1;
        return 0;
    }
    qsort(keys, (size_t)count, sizeof(Key), key_order);
    for (Py_ssize_t i = 1; i < count; i++)
        if (key_order(&keys[i - 1], &keys[i]) == 0)
            return 1;
    return 0;
}

static int value(Scan *s, int depth);

/* A str key (fixstr, str 8/16/32): its payload in ``key``; -1 for any other type. */
static int str_key(Scan *s, Key *key)
{
    if (s->at >= s->length)
        return -1;
    uint8_t type = s->data[s->at++];
    int64_t length = (type & 0xE0) == 0xA0 ? type & 0x1F
                     : type == 0xD9        ? take_uint(s, 1)
                     : type == 0xDA        ? take_uint(s, 2)
                     : type == 0xDB        ? take_uint(s, 4)
                                           : -1;
    key->bytes = s->data + s->at;
    key->length = (Py_ssize_t)length;
    return skip(s, length);
}

/* A container of ``count`` elements (pairs for a map) at nesting ``depth`` (1 for the top one). */
static int container(Scan *s, int64_t count, int is_map, int depth)
{
    if (count < 0 || depth > s->max_depth || ++s->containers > s->max_containers)
        return -1;
    if (count > (s->length - s->at) / (is_map ? 2 : 1)) /* every element takes at least one byte */
        return -1;
    if (!is_map) {
        for (int64_t i = 0; i < count; i++)
            if (value(s, depth) < 0)
                return -1;
        return 0;
    }
    Key *keys = count ? malloc((size_t)count * sizeof(Key)) : NULL;
    if (count && keys == NULL)
        return -1; /* the hooks will parse it, or say what is wrong */
    int status = 0;
    for (int64_t i = 0; i < count && status == 0; i++)
        status = str_key(s, &keys[i]) < 0 || value(s, depth) < 0 ? -1 : 0;
    if (status == 0 && any_twice(keys, (Py_ssize_t)count))
        status = -1;
    free(keys);
    return status;
}

/* One msgpack object inside a container at nesting ``depth`` (0 for the top-level object). */
static int value(Scan *s, int depth)
{
    if (s->at >= s->length)
        return -1;
    uint8_t type = s->data[s->at++];
    if (type <= 0x7F || type >= 0xE0) /* fixint */
        return 0;
    if (type <= 0x8F)
        return container(s, type & 0x0F, 1, depth + 1);
    if (type <= 0x9F)
        return container(s, type & 0x0F, 0, depth + 1);
    if (type <= 0xBF) /* fixstr */
        return skip(s, type & 0x1F);
    switch (type) {
    case 0xC0: case 0xC2: case 0xC3: return 0;                             /* nil, false, true */
    case 0xC4: case 0xD9: return skip(s, take_uint(s, 1));                 /* bin 8, str 8 */
    case 0xC5: case 0xDA: return skip(s, take_uint(s, 2));                 /* bin 16, str 16 */
    case 0xC6: case 0xDB: return skip(s, take_uint(s, 4));                 /* bin 32, str 32 */
    case 0xC7: { int64_t n = take_uint(s, 1); return n < 0 ? -1 : skip(s, n + 1); } /* ext 8: type byte too */
    case 0xC8: { int64_t n = take_uint(s, 2); return n < 0 ? -1 : skip(s, n + 1); }
    case 0xC9: { int64_t n = take_uint(s, 4); return n < 0 ? -1 : skip(s, n + 1); }
    case 0xCA: return skip(s, 4);                                           /* float 32 */
    case 0xCB: return skip(s, 8);                                           /* float 64 */
    case 0xCC: case 0xD0: return skip(s, 1);                                /* (u)int 8 */
    case 0xCD: case 0xD1: return skip(s, 2);
    case 0xCE: case 0xD2: return skip(s, 4);
    case 0xCF: case 0xD3: return skip(s, 8);
    case 0xD4: return skip(s, 2);                                           /* fixext 1..16: type byte too */
    case 0xD5: return skip(s, 3);
    case 0xD6: return skip(s, 5);
    case 0xD7: return skip(s, 9);
    case 0xD8: return skip(s, 17);
    case 0xDC: return container(s, take_uint(s, 2), 0, depth + 1);         /* array 16 */
    case 0xDD: return container(s, take_uint(s, 4), 0, depth + 1);         /* array 32 */
    case 0xDE: return container(s, take_uint(s, 2), 1, depth + 1);         /* map 16 */
    case 0xDF: return container(s, take_uint(s, 4), 1, depth + 1);         /* map 32 */
    default: return -1;                                                     /* 0xC1, never used */
    }
}

static PyObject *py_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "plain() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    long max_depth = PyLong_AsLong(args[1]);
    if (max_depth == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t max_containers = PyLong_AsSsize_t(args[2]);
    if (max_containers == -1 && PyErr_Occurred())
        return NULL;
    if (max_depth < 0 || max_depth > 64 || max_containers < 0) {
        PyErr_SetString(PyExc_ValueError, "plain(): max_depth must be in [0, 64] and max_containers >= 0");
        return NULL;
    }
    Py_buffer raw;
    if (PyObject_GetBuffer(args[0], &raw, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Scan s = {raw.buf, raw.len, 0, 0, max_containers, (int)max_depth};
    int clean;
    Py_BEGIN_ALLOW_THREADS
    clean = value(&s, 0) == 0 && s.at == s.length;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&raw);
    return PyBool_FromLong(clean);
}

static PyMethodDef methods[] = {
    {"plain", (PyCFunction)(void (*)(void))py_plain, METH_FASTCALL,
     "plain(raw, max_depth, max_containers) -> bool: whether raw is one msgpack object with str map keys, none "
     "twice in a map, nested at most max_depth deep, with at most max_containers maps and arrays"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_msgpack_check",
                                    "Whether a .szt header needs msgpack's checking hooks.", -1, methods};

PyMODINIT_FUNC PyInit__msgpack_check(void) { return PyModule_Create(&module); }
