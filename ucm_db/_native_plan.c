/* ucm_db._native, part three: a chunk of a read's units planned for
 * load_units in one call, instead of a Python call per unit.
 *
 *   plan_units(keys, stored, heads, metas, namespace_id, raw_tables,
 *              below_frame_bytes, format) -> tuple[bytes, bytes]
 *       For each unit i (keys[i] the key asked for; stored[i], heads[i]
 *       and metas[i] its ``blocks``, ``heads`` and ``meta`` values as the
 *       read transaction returned them, None where absent; metas None when
 *       no namespace is checked), kinds[i] becomes
 *         1 (raw): the head is one ucm_db.codec.raw_loads.batch_checksum takes as
 *           raw: codec none, owned by keys[i], its frame table one that
 *           raw_tables (ucm_db.codec.header.RAW_TABLES) maps to the body's
 *           size;
 *         2 (shuffled): a zstd head batch_checksum takes (frames averaging
 *           fewer than below_frame_bytes raw bytes, if it is not negative);
 *         0: anything else, left to the Python path, which decides it as it
 *           did before: absent, of another namespace (meta's first 16 bytes
 *           differ from namespace_id), a body that is not the whole stored
 *           value (a block written before format 3), any check failed.
 *       checksums[8i:8i+8] is the stored XXH3-64 of a unit of kind 1 or 2,
 *       little-endian (zero otherwise). format is the codec's constants:
 *       (magic, version, none id, zstd id, max frames, max raw bytes).
 *
 * Invariants:
 *     * A unit of kind 1 or 2 is exactly one that the tier's per-unit path
 *       (index_reads.with_blocks: in_namespace, body_of) would have handed
 *       to batch_checksum with the same body and that batch_checksum
 *       accepts with the same kind and checksum (tests/test_batch_plan.py
 *       compares them over valid and damaged heads).
 *     * Reads only: no buffer is written, no dict entry added; raw_tables
 *       is looked up under the GIL (this call holds it throughout).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_native_loads.h"

/* ucm_db/codec/header.py: HEADER_STRUCT "<4sHBBIQQ32sQ", FRAME_STRUCT 24 bytes. */
#define HEADER_BYTES 68
#define VERSION_AT 4
#define CODEC_AT 6
#define N_FRAMES_AT 8
#define RAW_LEN_AT 12
#define BODY_LEN_AT 20
#define OWNER_AT 28
#define OWNER_BYTES 32
#define CHECKSUM_AT 60
#define FRAME_BYTES 24
#define NAMESPACE_ID_BYTES 16
/* A whole meta record's length: ucm_db.index.entries.META.size (tests/test_batch_plan.py checks it). */
#define META_RECORD_BYTES 88
/* Its raw and stored sizes (ucm_db.index.entries: META, MAX_STORED_BYTES). */
#define META_RAW_AT 52
#define META_STORED_AT 60

enum { KIND_SKIP = 0, KIND_RAW = 1, KIND_SHUFFLED = 2 };

typedef struct {
    char magic[4];
    unsigned long version, none_id, zstd_id;
    unsigned long long max_frames, max_raw_bytes;
} format_t;

static uint64_t le_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) {
        v = (v << 8) | p[k];
    }
    return v;
}

static uint32_t le_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The frame table last found raw over a body size (most units of a read
 * share one table): compared before raw_tables is asked again. */
typedef struct {
    uint8_t table[FRAME_BYTES * 8];
    Py_ssize_t table_bytes;
    uint64_t body_bytes;
} last_raw_t;

/* Whether raw_tables maps this head's frame table to body_bytes; -1 with an
 * error set. */
static int raw_table_known(PyObject *raw_tables, const uint8_t *head, Py_ssize_t head_bytes, uint64_t body_bytes,
                           last_raw_t *last)
{
    const uint8_t *table = head + HEADER_BYTES;
    Py_ssize_t table_bytes = head_bytes - HEADER_BYTES;
    if (last->table_bytes == table_bytes && last->body_bytes == body_bytes && memcmp(last->table, table, (size_t)table_bytes) == 0) {
        return 1;
    }
    PyObject *key = PyBytes_FromStringAndSize((const char *)table, table_bytes);
    if (key == NULL) {
        return -1;
    }
    PyObject *total = PyDict_GetItemWithError(raw_tables, key);  /* borrowed */
    Py_DECREF(key);
    if (total == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyLong_Check(total)) {
        return 0;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(total);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (value != body_bytes) {
        return 0;
    }
    if (table_bytes <= (Py_ssize_t)sizeof(last->table)) {
        memcpy(last->table, table, (size_t)table_bytes);
        last->table_bytes = table_bytes;
        last->body_bytes = body_bytes;
    }
    return 1;
}

/* The kind of one unit whose views are pinned (see the top comment); -1
 * with an error set. */
static int plan_one(const format_t *f, PyObject *raw_tables, Py_ssize_t below, const Py_buffer *key, const Py_buffer *stored,
                    const Py_buffer *head, uint64_t *checksum, last_raw_t *last)
{
    const uint8_t *h = head->buf;
    Py_ssize_t head_bytes = head->len;
    if (head_bytes <= HEADER_BYTES) {
        return KIND_SKIP;
    }
    if (stored->len > head_bytes && memcmp(stored->buf, h, (size_t)head_bytes) == 0) {
        return KIND_SKIP;  /* the head is stored before the body (format 2): body_of slices it */
    }
    uint64_t body_bytes = (uint64_t)stored->len;
    uint32_t n_frames = le_u32(h + N_FRAMES_AT);
    uint64_t raw_len = le_u64(h + RAW_LEN_AT);
    if (memcmp(h, f->magic, 4) != 0 || (unsigned long)(h[VERSION_AT] | h[VERSION_AT + 1] << 8) != f->version ||
        key->len != OWNER_BYTES || memcmp(h + OWNER_AT, key->buf, OWNER_BYTES) != 0 || le_u64(h + BODY_LEN_AT) != body_bytes ||
        n_frames > f->max_frames || raw_len > f->max_raw_bytes ||
        (Py_ssize_t)(HEADER_BYTES + (uint64_t)n_frames * FRAME_BYTES) != head_bytes) {
        return KIND_SKIP;
    }
    unsigned long codec_id = h[CODEC_AT];
    int kind = KIND_SKIP;
    if (codec_id == f->none_id) {
        if (raw_len == body_bytes) {
            int known = raw_table_known(raw_tables, h, head_bytes, body_bytes, last);
            if (known < 0) {
                return -1;
            }
            kind = known ? KIND_RAW : KIND_SKIP;
        }
    } else if (codec_id == f->zstd_id && n_frames > 0 && (below < 0 || raw_len / n_frames < (uint64_t)below)) {
        kind = KIND_SHUFFLED;
    }
    if (kind != KIND_SKIP) {
        *checksum = le_u64(h + CHECKSUM_AT);
    }
    return kind;
}

/* Whether meta is a whole record (a record's length and sizes some block can
 * have: ucm_db.index.entries.plausible_meta; another is damaged, left to the
 * Python path, which files it) and names the namespace (its first 16 bytes
 * are namespace_id). */
static int in_namespace(PyObject *meta, const Py_buffer *namespace_id, const format_t *f, int *error)
{
    Py_buffer m;
    if (PyObject_GetBuffer(meta, &m, PyBUF_SIMPLE) < 0) {
        *error = 1;
        return 0;
    }
    int same = m.len == META_RECORD_BYTES && namespace_id->len == NAMESPACE_ID_BYTES &&
               memcmp(m.buf, namespace_id->buf, NAMESPACE_ID_BYTES) == 0;
    if (same) {
        const uint8_t *p = (const uint8_t *)m.buf;
        unsigned long long max_stored = f->max_raw_bytes + 2ULL * (HEADER_BYTES + f->max_frames * 32ULL);
        same = le_u64(p + META_RAW_AT) <= f->max_raw_bytes && le_u64(p + META_STORED_AT) <= max_stored;
    }
    PyBuffer_Release(&m);
    return same;
}

PyObject *native_plan_units(PyObject *module, PyObject *args)
{
    PyObject *keys, *stored, *heads, *metas, *namespace_obj, *raw_tables;
    Py_ssize_t below;
    format_t f;
    const char *magic;
    Py_ssize_t magic_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOOOOOn(y#kkkKK):plan_units", &keys, &stored, &heads, &metas, &namespace_obj, &raw_tables,
                          &below, &magic, &magic_bytes, &f.version, &f.none_id, &f.zstd_id, &f.max_frames, &f.max_raw_bytes)) {
        return NULL;
    }
    if (magic_bytes != 4) {
        PyErr_SetString(PyExc_ValueError, "the format's magic must be 4 bytes");
        return NULL;
    }
    memcpy(f.magic, magic, 4);
    if (!PyList_Check(keys) || !PyList_Check(stored) || !PyList_Check(heads) || (metas != Py_None && !PyList_Check(metas)) ||
        !PyDict_Check(raw_tables)) {
        PyErr_SetString(PyExc_TypeError, "keys, stored and heads must be lists, metas a list or None, raw_tables a dict");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(stored) != n || PyList_GET_SIZE(heads) != n || (metas != Py_None && PyList_GET_SIZE(metas) != n)) {
        PyErr_SetString(PyExc_ValueError, "keys, stored, heads and metas need one entry per unit");
        return NULL;
    }
    Py_buffer namespace_id = {0};
    if (metas != Py_None && PyObject_GetBuffer(namespace_obj, &namespace_id, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *kinds = PyBytes_FromStringAndSize(NULL, n);
    PyObject *checksums = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (kinds == NULL || checksums == NULL) {
        goto fail;
    }
    uint8_t *kind_at = (uint8_t *)PyBytes_AS_STRING(kinds);
    uint8_t *sum_at = (uint8_t *)PyBytes_AS_STRING(checksums);
    memset(sum_at, 0, (size_t)(8 * n));
    last_raw_t last = {.table_bytes = -1};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(stored, i), *h = PyList_GET_ITEM(heads, i);
        kind_at[i] = KIND_SKIP;
        if (s == Py_None || h == Py_None) {
            continue;
        }
        if (metas != Py_None) {
            PyObject *m = PyList_GET_ITEM(metas, i);
            int error = 0;
            if (m == Py_None || !in_namespace(m, &namespace_id, &f, &error)) {
                if (error) {
                    goto fail;
                }
                continue;
            }
        }
        Py_buffer key_view, stored_view, head_view;
        if (PyObject_GetBuffer(PyList_GET_ITEM(keys, i), &key_view, PyBUF_SIMPLE) < 0) {
            goto fail;
        }
        if (PyObject_GetBuffer(s, &stored_view, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&key_view);
            goto fail;
        }
        if (PyObject_GetBuffer(h, &head_view, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&key_view);
            PyBuffer_Release(&stored_view);
            goto fail;
        }
        uint64_t checksum = 0;
        int kind = plan_one(&f, raw_tables, below, &key_view, &stored_view, &head_view, &checksum, &last);
        PyBuffer_Release(&key_view);
        PyBuffer_Release(&stored_view);
        PyBuffer_Release(&head_view);
        if (kind < 0) {
            goto fail;
        }
        kind_at[i] = (uint8_t)kind;
        for (int k = 0; k < 8; k++) {
            sum_at[8 * i + k] = (uint8_t)(checksum >> (8 * k));
        }
    }
    if (namespace_id.obj != NULL) {
        PyBuffer_Release(&namespace_id);
    }
    PyObject *result = PyTuple_Pack(2, kinds, checksums);
    Py_DECREF(kinds);
    Py_DECREF(checksums);
    return result;
fail:
    if (namespace_id.obj != NULL) {
        PyBuffer_Release(&namespace_id);
    }
    Py_XDECREF(kinds);
    Py_XDECREF(checksums);
    return NULL;
}
