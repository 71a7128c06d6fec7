/* ucm_db._native: the codec's byte-plane shuffle, in C.
 *
 * Optional: ucm_db/codec/native.py falls back to numpy when this module is not
 * built, and tests/test_native.py checks that both give the same bytes.
 * Key derivation is not here: block keys use hashlib's BLAKE2b
 * (ucm_db/keys/chain.py), one maintained implementation for every key.
 *
 *   split_planes(src, element_bytes) -> list[bytearray]
 *       plane i holds byte i (least significant first) of each
 *       little-endian element; element_bytes is 2 or 4.
 *   merge_planes(planes, out, element_bytes) -> None
 *       the inverse, written straight into the caller's buffer.
 *   merge_planes_into(planes, outs, element_bytes, skip_bytes) -> int
 *       merge_planes into a buffer or a scatter list (a list or tuple of
 *       buffers filled one after another), starting skip_bytes into it: a
 *       decoded frame goes straight to its place in a block's scatter list
 *       (e.g. a KV cache's layer slabs), with no staging copy. Every out it
 *       crosses ends between two elements.
 *   merge_planes_into_slabs(planes, views, slab_bytes, index, element_bytes, skip_bytes) -> int
 *       merge_planes_into whose outs are slab `index` of each of views (as
 *       copy_into_slabs below).
 *   copy_into(src, outs, hasher, chunk_bytes) -> int
 *       src copied into a buffer or a scatter list of buffers; with a
 *       hasher (an xxhash streaming object, or anything with update()),
 *       each chunk of at most chunk_bytes (0: all of src) is hashed in one
 *       update() call (however many outs it spans) right before it is
 *       copied, so the copy reads it from cache, not memory:
 *       a checksum verified while copying reads each byte from memory once.
 *   copy_into_slabs(src, views, slab_bytes, index, hasher, chunk_bytes) -> int
 *       copy_into whose outs are slab `index` of each of views (a tuple of
 *       large buffers, slab_bytes a tuple of their slab sizes): a block's
 *       scatter list over a KV cache's layers without a Python object per
 *       slab (ucm_db.codec.slabs.ScatterSlabs).
 *   gather_slabs(views, slab_bytes, indices, out) -> int
 *       the inverse of copy_into_slabs for many blocks at once: row r of out
 *       (rows of sum(slab_bytes) bytes) becomes slab indices[r] of each of
 *       views, one after another. A connector's save step copies its units
 *       out of the KV cache in one call that keeps the GIL (see below).
 *
 * Why C: on 2 MiB of 2-byte elements these loops run about 4x faster than
 * the numpy fallback (about 20 against 5 GB/s on the 2-core development
 * machine), and they sit on every compressed put and get.
 *
 * The GIL is released around the loops once their inputs are pinned, but
 * only for large calls: a release lets a waiting thread run, and getting the
 * GIL back can then take a whole switch interval (5 ms by default).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "_native_kernels.h"
#include "_native_loads.h"

/* Below this many bytes of work a call keeps the GIL (see above). */
#define RELEASE_GIL_BYTES ((Py_ssize_t)64 * 1024)
/* gather_slabs keeps the GIL up to this many bytes: it runs on the model's
 * thread, and one release per step let a busy writer thread take the GIL for
 * up to a switch interval (a 4 MiB step's gather measured 0.85 ms alone,
 * p90 3.2 ms beside a committing writer). Past this size the copy itself
 * outlasts a switch interval, so the release costs little. */
#define GATHER_KEEP_GIL_BYTES ((Py_ssize_t)32 * 1024 * 1024)

/* ------------------------------------------------------------------------
 * Byte planes
 * ------------------------------------------------------------------------ */

static int check_element_bytes(int element_bytes)
{
    if (element_bytes != 2 && element_bytes != 4) {
        PyErr_Format(PyExc_ValueError, "element_bytes must be 2 or 4, got %d", element_bytes);
        return -1;
    }
    return 0;
}

static void split2(const uint8_t *src, size_t n, uint8_t *p0, uint8_t *p1)
{
#if PY_LITTLE_ENDIAN
    /* Whole-word loads let the compiler vectorise with plain SSE2/NEON. */
    for (size_t i = 0; i < n; i++) {
        uint16_t w;
        memcpy(&w, src + 2 * i, 2);
        p0[i] = (uint8_t)w;
        p1[i] = (uint8_t)(w >> 8);
    }
#else
    for (size_t i = 0; i < n; i++) {
        p0[i] = src[2 * i];
        p1[i] = src[2 * i + 1];
    }
#endif
}

static void split4(const uint8_t *src, size_t n, uint8_t *p0, uint8_t *p1, uint8_t *p2, uint8_t *p3)
{
#if PY_LITTLE_ENDIAN
    for (size_t i = 0; i < n; i++) {
        uint32_t w;
        memcpy(&w, src + 4 * i, 4);
        p0[i] = (uint8_t)w;
        p1[i] = (uint8_t)(w >> 8);
        p2[i] = (uint8_t)(w >> 16);
        p3[i] = (uint8_t)(w >> 24);
    }
#else
    for (size_t i = 0; i < n; i++) {
        p0[i] = src[4 * i];
        p1[i] = src[4 * i + 1];
        p2[i] = src[4 * i + 2];
        p3[i] = src[4 * i + 3];
    }
#endif
}


static void split_any(const uint8_t *src, size_t n, int element_bytes, uint8_t *const p[4])
{
    if (element_bytes == 2) {
        split2(src, n, p[0], p[1]);
    } else {
        split4(src, n, p[0], p[1], p[2], p[3]);
    }
}

static void merge_any(uint8_t *out, size_t n, int element_bytes, const Py_buffer planes[4])
{
    if (element_bytes == 2) {
        merge2(out, n, planes[0].buf, planes[1].buf);
    } else {
        merge4(out, n, planes[0].buf, planes[1].buf, planes[2].buf, planes[3].buf);
    }
}

static PyObject *native_split_planes(PyObject *module, PyObject *args)
{
    Py_buffer src;
    int element_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*i:split_planes", &src, &element_bytes)) {
        return NULL;
    }
    PyObject *planes = NULL;
    uint8_t *p[4] = {NULL, NULL, NULL, NULL};
    if (check_element_bytes(element_bytes) < 0) {
        goto done;
    }
    if (src.len % element_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "src holds %zd bytes, not a multiple of element_bytes %d", src.len, element_bytes);
        goto done;
    }
    Py_ssize_t n = src.len / element_bytes;
    planes = PyList_New(element_bytes);
    if (planes == NULL) {
        goto done;
    }
    for (int i = 0; i < element_bytes; i++) {
        PyObject *plane = PyByteArray_FromStringAndSize(NULL, n); /* uninitialised: every byte is written below */
        if (plane == NULL) {
            Py_CLEAR(planes);
            goto done;
        }
        p[i] = (uint8_t *)PyByteArray_AS_STRING(plane);
        PyList_SET_ITEM(planes, i, plane);
    }
    /* The new bytearrays are not shared yet, and src stays pinned by its buffer export. */
    if (src.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        split_any(src.buf, (size_t)n, element_bytes, p);
        Py_END_ALLOW_THREADS
    } else {
        split_any(src.buf, (size_t)n, element_bytes, p);
    }

done:
    PyBuffer_Release(&src);
    return planes;
}


/* A block's byte planes pinned (element_bytes of them, of equal length). */
typedef struct {
    PyObject *seq;
    Py_buffer views[4];
    int element_bytes, pinned;
} planes_t;

static void planes_release(planes_t *p)
{
    for (int i = 0; i < p->pinned; i++) {
        PyBuffer_Release(&p->views[i]);
    }
    Py_XDECREF(p->seq);
}

/* Pins planes_obj (a sequence of element_bytes equal buffers) into p; 0 on
 * success, -1 with an exception set and nothing held. */
static int planes_pin(planes_t *p, PyObject *planes_obj, int element_bytes)
{
    memset(p, 0, sizeof(*p));
    p->element_bytes = element_bytes;
    if (check_element_bytes(element_bytes) < 0) {
        return -1;
    }
    p->seq = PySequence_Fast(planes_obj, "planes must be a sequence of buffers");
    if (p->seq == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(p->seq) != element_bytes) {
        PyErr_Format(PyExc_ValueError, "got %zd planes for element_bytes %d", PySequence_Fast_GET_SIZE(p->seq), element_bytes);
        planes_release(p);
        return -1;
    }
    for (; p->pinned < element_bytes; p->pinned++) {
        Py_buffer *view = &p->views[p->pinned];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(p->seq, p->pinned), view, PyBUF_SIMPLE) < 0) {
            planes_release(p);
            return -1;
        }
        if (view->len != p->views[0].len) {
            PyErr_Format(PyExc_ValueError, "plane %d holds %zd bytes, plane 0 %zd", p->pinned, view->len, p->views[0].len);
            p->pinned++;
            planes_release(p);
            return -1;
        }
    }
    return 0;
}

static PyObject *native_merge_planes(PyObject *module, PyObject *args)
{
    PyObject *planes_obj, *out_obj;
    int element_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOi:merge_planes", &planes_obj, &out_obj, &element_bytes)) {
        return NULL;
    }
    planes_t planes;
    if (planes_pin(&planes, planes_obj, element_bytes) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer out;
    int have_out = 0;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "out must be a writable contiguous buffer, not a read-only or strided %.100s",
                         Py_TYPE(out_obj)->tp_name);
        }
        goto done;
    }
    have_out = 1;
    Py_ssize_t n = planes.views[0].len;
    if (out.len != n * element_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes where %d planes of %zd need %zd", out.len, element_bytes, n,
                     n * element_bytes);
        goto done;
    }
    for (int i = 0; i < element_bytes; i++) {
        if (overlaps(&out, &planes.views[i])) {
            PyErr_SetString(PyExc_ValueError, "out overlaps a plane");
            goto done;
        }
    }
    /* Plain stores: the out of a single-buffer decode (often this thread's
     * scratch) is read again right away. */
    if (out.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        merge_any(out.buf, (size_t)n, element_bytes, planes.views);
        Py_END_ALLOW_THREADS
    } else {
        merge_any(out.buf, (size_t)n, element_bytes, planes.views);
    }
    result = Py_NewRef(Py_None);

done:
    if (have_out) {
        PyBuffer_Release(&out);
    }
    planes_release(&planes);
    return result;
}

/* ------------------------------------------------------------------------
 * Copy (and hash) into a scatter list
 * ------------------------------------------------------------------------ */

static void release_all(Py_buffer *views, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&views[i]);
    }
}

/* hasher.update(view of [at, at + n) of src); 0 on success. */
static int hash_piece(PyObject *update, const char *at, Py_ssize_t n)
{
    PyObject *piece = PyMemoryView_FromMemory((char *)at, n, PyBUF_READ);
    if (piece == NULL) {
        return -1;
    }
    PyObject *done = PyObject_CallOneArg(update, piece);
    Py_DECREF(piece);
    if (done == NULL) {
        return -1;
    }
    Py_DECREF(done);
    return 0;
}

/* hash_piece as a chunk_hash_t (hasher: a bound update method). */
static int python_hash(void *hasher, const char *at, Py_ssize_t n)
{
    return hash_piece((PyObject *)hasher, at, n);
}


/* src[0, len) into pieces filled one after another; with update (a hasher's
 * bound update method) each chunk of at most chunk_bytes is hashed right
 * before it is copied. The pieces hold at least len bytes (checked by the
 * callers). 0 on success, -1 with an exception set if update raised. */
static int hashed_copy(const char *src, Py_ssize_t len, const piece_t *pieces, PyObject *update, Py_ssize_t chunk_bytes)
{
    if (update == NULL) {
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; at < len; i++) {
            Py_ssize_t n = pieces[i].len < len - at ? pieces[i].len : len - at;
            copy_piece(pieces[i].buf, src + at, n);
            at += n;
        }
        return 0;
    }
    return hash_then_copy(src, len, pieces, python_hash, update, chunk_bytes);
}

/* Pins item as a writable contiguous buffer (a clear TypeError if it is not). */
static int pin_writable(PyObject *item, Py_buffer *view)
{
    if (PyObject_GetBuffer(item, view, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "out must be a writable contiguous buffer, not a read-only or strided %.100s",
                         Py_TYPE(item)->tp_name);
        }
        return -1;
    }
    return 0;
}

/* Copies src into pieces (hashed on the way if hasher is not None),
 * releasing the GIL for large copies without a hasher. */
static PyObject *copy_pieces(Py_buffer *src, piece_t *pieces, PyObject *hasher, Py_ssize_t chunk_bytes)
{
    if (hasher == Py_None) {
        if (src->len >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            hashed_copy(src->buf, src->len, pieces, NULL, 0);
            Py_END_ALLOW_THREADS
        } else {
            hashed_copy(src->buf, src->len, pieces, NULL, 0);
        }
        return PyLong_FromSsize_t(src->len);
    }
    PyObject *update = PyObject_GetAttrString(hasher, "update");
    if (update == NULL) {
        return NULL;
    }
    int failed = hashed_copy(src->buf, src->len, pieces, update, chunk_bytes);
    Py_DECREF(update);
    return failed ? NULL : PyLong_FromSsize_t(src->len);
}

/* A scatter list pinned: a buffer, or a list or tuple of buffers filled
 * one after another. */
typedef struct {
    PyObject *seq;     /* the list or tuple (NULL for one buffer) */
    Py_buffer *views;  /* pinned[0, pinned) are held */
    piece_t *pieces;
    Py_ssize_t n, pinned, room;
} scatter_t;

static void scatter_release(scatter_t *s)
{
    PyMem_Free(s->pieces);
    if (s->views != NULL) {
        release_all(s->views, s->pinned);
        PyMem_Free(s->views);
    }
    Py_XDECREF(s->seq);
}

/* Pins outs_obj's buffers (writable, contiguous) into s, refusing any that
 * overlaps one of the n_inputs inputs; 0 on success, -1 with an exception
 * set (s is released by the caller either way). */
static int scatter_pin(scatter_t *s, PyObject *outs_obj, const Py_buffer *inputs, int n_inputs)
{
    memset(s, 0, sizeof(*s));
    if (PyList_Check(outs_obj) || PyTuple_Check(outs_obj)) {
        s->seq = PySequence_Fast(outs_obj, "outs must be a buffer or a list of buffers");
        if (s->seq == NULL) {
            return -1;
        }
        s->n = PySequence_Fast_GET_SIZE(s->seq);
    } else {
        s->n = 1;
    }
    s->views = PyMem_Calloc(s->n ? (size_t)s->n : 1, sizeof(Py_buffer));
    s->pieces = PyMem_Calloc(s->n ? (size_t)s->n : 1, sizeof(piece_t));
    if (s->views == NULL || s->pieces == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (; s->pinned < s->n; s->pinned++) {
        PyObject *item = s->seq ? PySequence_Fast_GET_ITEM(s->seq, s->pinned) : outs_obj;
        Py_buffer *view = &s->views[s->pinned];
        if (pin_writable(item, view) < 0) {
            return -1;
        }
        for (int j = 0; j < n_inputs; j++) {
            if (overlaps(view, &inputs[j])) {
                s->pinned++;
                PyErr_SetString(PyExc_ValueError, "an out buffer overlaps an input");
                return -1;
            }
        }
        s->pieces[s->pinned].buf = view->buf;
        s->pieces[s->pinned].len = view->len;
        s->room += view->len;
    }
    return 0;
}

static PyObject *native_copy_into(PyObject *module, PyObject *args)
{
    Py_buffer src;
    PyObject *outs_obj, *hasher;
    Py_ssize_t chunk_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*OOn:copy_into", &src, &outs_obj, &hasher, &chunk_bytes)) {
        return NULL;
    }
    PyObject *result = NULL;
    scatter_t outs;
    if (scatter_pin(&outs, outs_obj, &src, 1) < 0) {
        goto done;
    }
    if (outs.room < src.len) {
        PyErr_Format(PyExc_ValueError, "outs hold %zd bytes, fewer than the %zd of src", outs.room, src.len);
        goto done;
    }
    result = copy_pieces(&src, outs.pieces, hasher, chunk_bytes);
done:
    scatter_release(&outs);
    PyBuffer_Release(&src);
    return result;
}

/* ------------------------------------------------------------------------
 * Byte planes merged into a scatter list
 * ------------------------------------------------------------------------ */


/* Whether n elements written skip bytes into pieces find room, each piece
 * they cross holding whole elements; -1 with a ValueError set if not. */
static int check_merge_room(const piece_t *pieces, Py_ssize_t n_pieces, Py_ssize_t skip, Py_ssize_t nbytes, int element_bytes)
{
    if (skip < 0 || skip % element_bytes) {
        PyErr_Format(PyExc_ValueError, "skip_bytes %zd is not a whole number of %d-byte elements", skip, element_bytes);
        return -1;
    }
    Py_ssize_t at = 0, end = skip + nbytes; /* at: where piece i starts */
    for (Py_ssize_t i = 0; i < n_pieces && at < end; i++) {
        Py_ssize_t stop = at + pieces[i].len;
        if (stop > skip && stop < end && stop % element_bytes) {
            PyErr_Format(PyExc_ValueError, "out %zd ends inside an element (%zd bytes, element_bytes %d)", i,
                         pieces[i].len, element_bytes);
            return -1;
        }
        at = stop;
    }
    if (at < end) {
        PyErr_Format(PyExc_ValueError, "outs hold %zd bytes, fewer than skip_bytes %zd plus the %zd merged", at, skip,
                     nbytes);
        return -1;
    }
    return 0;
}

/* The planes merged into outs' pieces from skip on; the bytes written, or
 * NULL with a ValueError if the pieces cannot take them (nothing written). */
static PyObject *merge_into(const planes_t *planes, const scatter_t *outs, Py_ssize_t skip)
{
    int element_bytes = planes->element_bytes;
    Py_ssize_t n = planes->views[0].len, nbytes = n * element_bytes;
    if (check_merge_room(outs->pieces, outs->n, skip, nbytes, element_bytes) < 0) {
        return NULL;
    }
    if (n > 0) {
        if (nbytes >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            merge_pieces(outs->pieces, skip, (size_t)n, element_bytes, planes->views);
            Py_END_ALLOW_THREADS
        } else {
            merge_pieces(outs->pieces, skip, (size_t)n, element_bytes, planes->views);
        }
    }
    return PyLong_FromSsize_t(nbytes);
}

static PyObject *native_merge_planes_into(PyObject *module, PyObject *args)
{
    PyObject *planes_obj, *outs_obj;
    int element_bytes;
    Py_ssize_t skip;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOin:merge_planes_into", &planes_obj, &outs_obj, &element_bytes, &skip)) {
        return NULL;
    }
    planes_t planes;
    if (planes_pin(&planes, planes_obj, element_bytes) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    scatter_t outs;
    if (scatter_pin(&outs, outs_obj, planes.views, element_bytes) == 0) {
        result = merge_into(&planes, &outs, skip);
    }
    scatter_release(&outs);
    planes_release(&planes);
    return result;
}

/* Most slab views one copy_into_slabs call takes (layers of a unit). */
#define MAX_SLAB_VIEWS 1024

/* Pins slab `index` of each of views_obj (a tuple of large buffers, their
 * slab sizes in the tuple sizes_obj) into s as its pieces, refusing a slab
 * that overlaps one of the n_inputs inputs; 0 on success, -1 with an
 * exception set (s is released by the caller either way). */
static int slabs_pin(scatter_t *s, PyObject *views_obj, PyObject *sizes_obj, Py_ssize_t index, const Py_buffer *inputs,
                     int n_inputs)
{
    memset(s, 0, sizeof(*s));
    Py_ssize_t n = PyTuple_GET_SIZE(views_obj);
    if (n == 0 || n > MAX_SLAB_VIEWS || PyTuple_GET_SIZE(sizes_obj) != n) {
        PyErr_Format(PyExc_ValueError, "got %zd views and %zd slab sizes (1 to %d of each, as many sizes as views)", n,
                     PyTuple_GET_SIZE(sizes_obj), MAX_SLAB_VIEWS);
        return -1;
    }
    if (index < 0) {
        PyErr_Format(PyExc_ValueError, "slab index %zd is negative", index);
        return -1;
    }
    s->n = n;
    s->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    s->pieces = PyMem_Calloc((size_t)n, sizeof(piece_t));
    if (s->views == NULL || s->pieces == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (; s->pinned < n; s->pinned++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes_obj, s->pinned));
        if (size == -1 && PyErr_Occurred()) {
            return -1;
        }
        Py_buffer *view = &s->views[s->pinned];
        if (pin_writable(PyTuple_GET_ITEM(views_obj, s->pinned), view) < 0) {
            return -1;
        }
        if (size <= 0 || index > view->len / size - 1) {
            PyErr_Format(PyExc_ValueError, "slab %zd of %zd bytes lies outside view %zd of %zd bytes", index, size,
                         s->pinned, view->len);
            s->pinned++;
            return -1;
        }
        Py_buffer slab = {.buf = (char *)view->buf + index * size, .len = size};
        for (int j = 0; j < n_inputs; j++) {
            if (overlaps(&slab, &inputs[j])) {
                PyErr_SetString(PyExc_ValueError, "a slab overlaps an input");
                s->pinned++;
                return -1;
            }
        }
        if (size > PY_SSIZE_T_MAX - s->room) {
            PyErr_SetString(PyExc_ValueError, "the slab sizes summed overflow");
            s->pinned++;
            return -1;
        }
        s->pieces[s->pinned].buf = slab.buf;
        s->pieces[s->pinned].len = size;
        s->room += size;
    }
    return 0;
}

static PyObject *native_copy_into_slabs(PyObject *module, PyObject *args)
{
    Py_buffer src;
    PyObject *views_obj, *sizes_obj, *hasher;
    Py_ssize_t index, chunk_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*O!O!nOn:copy_into_slabs", &src, &PyTuple_Type, &views_obj, &PyTuple_Type, &sizes_obj,
                          &index, &hasher, &chunk_bytes)) {
        return NULL;
    }
    PyObject *result = NULL;
    scatter_t slabs;
    if (slabs_pin(&slabs, views_obj, sizes_obj, index, &src, 1) < 0) {
        goto done;
    }
    if (slabs.room < src.len) {
        PyErr_Format(PyExc_ValueError, "slabs hold %zd bytes, fewer than the %zd of src", slabs.room, src.len);
        goto done;
    }
    result = copy_pieces(&src, slabs.pieces, hasher, chunk_bytes);
done:
    scatter_release(&slabs);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *native_merge_planes_into_slabs(PyObject *module, PyObject *args)
{
    PyObject *planes_obj, *views_obj, *sizes_obj;
    Py_ssize_t index, skip;
    int element_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO!O!nin:merge_planes_into_slabs", &planes_obj, &PyTuple_Type, &views_obj, &PyTuple_Type,
                          &sizes_obj, &index, &element_bytes, &skip)) {
        return NULL;
    }
    planes_t planes;
    if (planes_pin(&planes, planes_obj, element_bytes) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    scatter_t slabs;
    if (slabs_pin(&slabs, views_obj, sizes_obj, index, planes.views, element_bytes) == 0) {
        result = merge_into(&planes, &slabs, skip);
    }
    scatter_release(&slabs);
    planes_release(&planes);
    return result;
}

/* Row r of out (rows of the slab sizes summed) := slab indices[r] of each
 * view, in view order. Everything is checked before the first byte moves:
 * a bad index, a short out or an out overlapping a view raises ValueError
 * and writes nothing. */
static void gather_rows(char *dst, const Py_buffer *views, const Py_ssize_t *sizes, Py_ssize_t n, const Py_ssize_t *at,
                        Py_ssize_t rows)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        for (Py_ssize_t j = 0; j < n; j++) {
            memcpy(dst, (const char *)views[j].buf + at[r] * sizes[j], (size_t)sizes[j]);
            dst += sizes[j];
        }
    }
}

static PyObject *native_gather_slabs(PyObject *module, PyObject *args)
{
    PyObject *views_obj, *sizes_obj, *indices_obj, *out_obj;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!O!OO:gather_slabs", &PyTuple_Type, &views_obj, &PyTuple_Type, &sizes_obj, &indices_obj,
                          &out_obj)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(views_obj);
    if (n == 0 || n > MAX_SLAB_VIEWS || PyTuple_GET_SIZE(sizes_obj) != n) {
        PyErr_Format(PyExc_ValueError, "got %zd views and %zd slab sizes (1 to %d of each, as many sizes as views)", n,
                     PyTuple_GET_SIZE(sizes_obj), MAX_SLAB_VIEWS);
        return NULL;
    }
    PyObject *result = NULL, *indices = NULL;
    Py_buffer out = {0};
    Py_ssize_t pinned = 0, row_bytes = 0, slabs = PY_SSIZE_T_MAX, rows = 0;
    Py_buffer *views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    Py_ssize_t *sizes = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    Py_ssize_t *at = NULL;
    if (views == NULL || sizes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; pinned < n; pinned++) {
        sizes[pinned] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes_obj, pinned));
        if (sizes[pinned] == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(views_obj, pinned), &views[pinned], PyBUF_SIMPLE) < 0) {
            goto done;
        }
        if (sizes[pinned] <= 0) {
            PyErr_Format(PyExc_ValueError, "slab size %zd of view %zd is not positive", sizes[pinned], pinned);
            pinned++;
            goto done;
        }
        /* Checked before the sum: sizes past a view's bytes, summed, wrapped
         * row_bytes to 0 and the division by it below raised SIGFPE. */
        if (sizes[pinned] > views[pinned].len || sizes[pinned] > PY_SSIZE_T_MAX - row_bytes) {
            PyErr_Format(PyExc_ValueError, "slab size %zd of view %zd is over the view's %zd bytes or overflows the row size",
                         sizes[pinned], pinned, views[pinned].len);
            pinned++;
            goto done;
        }
        Py_ssize_t count = views[pinned].len / sizes[pinned];
        slabs = count < slabs ? count : slabs;
        row_bytes += sizes[pinned];
    }
    if (pin_writable(out_obj, &out) < 0) {
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (overlaps(&out, &views[j])) {
            PyErr_Format(PyExc_ValueError, "out overlaps view %zd", j);
            goto done;
        }
    }
    indices = PySequence_Fast(indices_obj, "indices must be a sequence of slab indices");
    if (indices == NULL) {
        goto done;
    }
    rows = PySequence_Fast_GET_SIZE(indices);
    if (rows > out.len / row_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, fewer than %zd rows of %zd", out.len, rows, row_bytes);
        goto done;
    }
    at = PyMem_Calloc((size_t)(rows > 0 ? rows : 1), sizeof(Py_ssize_t));
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        at[r] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(indices, r));
        if (at[r] == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (at[r] < 0 || at[r] >= slabs) {
            PyErr_Format(PyExc_ValueError, "slab index %zd outside the views' %zd slabs", at[r], slabs);
            goto done;
        }
    }
    if (rows * row_bytes > GATHER_KEEP_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        gather_rows(out.buf, views, sizes, n, at, rows);
        Py_END_ALLOW_THREADS
    } else {
        gather_rows(out.buf, views, sizes, n, at, rows);
    }
    result = PyLong_FromSsize_t(rows * row_bytes);
done:
    PyMem_Free(at);
    Py_XDECREF(indices);
    if (out.obj != NULL) {
        PyBuffer_Release(&out);
    }
    if (views != NULL) {
        release_all(views, pinned);
    }
    PyMem_Free(views);
    PyMem_Free(sizes);
    return result;
}

/* ------------------------------------------------------------------------
 * Module
 * ------------------------------------------------------------------------ */

static PyMethodDef native_methods[] = {
    {"split_planes", native_split_planes, METH_VARARGS,
     "split_planes(src, element_bytes, /) -> list[bytearray]\n\n"
     "Byte planes of little-endian elements, least significant byte first."},
    {"merge_planes", native_merge_planes, METH_VARARGS,
     "merge_planes(planes, out, element_bytes, /) -> None\n\n"
     "Interleaves byte planes back into elements, written into out."},
    {"merge_planes_into", native_merge_planes_into, METH_VARARGS,
     "merge_planes_into(planes, outs, element_bytes, skip_bytes, /) -> int\n\n"
     "merge_planes into a buffer or a scatter list, skip_bytes into it; returns the bytes written."},
    {"merge_planes_into_slabs", native_merge_planes_into_slabs, METH_VARARGS,
     "merge_planes_into_slabs(planes, views, slab_bytes, index, element_bytes, skip_bytes, /) -> int\n\n"
     "merge_planes_into whose outs are slab index of each of views (tuples)."},
    {"copy_into", native_copy_into, METH_VARARGS,
     "copy_into(src, outs, hasher, chunk_bytes, /) -> int\n\n"
     "Copies src into outs (a buffer, or a list or tuple filled one after another);\n"
     "with a hasher, hasher.update(piece) runs on each piece right before its copy."},
    {"copy_into_slabs", native_copy_into_slabs, METH_VARARGS,
     "copy_into_slabs(src, views, slab_bytes, index, hasher, chunk_bytes, /) -> int\n\n"
     "copy_into with the outs views[j][index * slab_bytes[j]:(index + 1) * slab_bytes[j]] (tuples)."},
    {"gather_slabs", native_gather_slabs, METH_VARARGS,
     "gather_slabs(views, slab_bytes, indices, out, /) -> int\n\n"
     "Row r of out (rows of sum(slab_bytes) bytes) := slab indices[r] of each of views, in order."},
    {"bind_loads", native_bind_loads, METH_VARARGS,
     "bind_loads(xxh3_paths, zstd_paths, /) -> tuple[str | None, str | None]\n\n"
     "Binds XXH3-64 and the zstd decompressor from the first library of each list that has them."},
    {"xxh3_update_name", native_xxh3_update_name, METH_NOARGS,
     "xxh3_update_name() -> str | None\n\nThe XXH3-64 update symbol bind_loads bound (None: unbound)."},
    {"loads_bound", native_loads_bound, METH_NOARGS,
     "loads_bound() -> tuple[bool, bool]\n\nWhether XXH3-64 and zstd are bound."},
    {"xxh3_parts", native_xxh3_parts, METH_VARARGS,
     "xxh3_parts(parts, /) -> int\n\nThe bound XXH3-64 of the buffers of a tuple, one after another."},
    {"zstd_decompress", native_zstd_decompress, METH_VARARGS,
     "zstd_decompress(frame, size, /) -> bytes | None\n\nThe bound zstd's output of exactly size bytes, or None."},
    {"load_units", native_load_units, METH_VARARGS,
     "load_units(heads, bodies, kinds, checksums, views, slab_bytes, indices, state, chunk_units, chunk_bytes, /) -> int\n\n"
     "Verifies and writes a batch's units into slabs without the GIL (see _native_loads.c)."},
    {"plan_units", native_plan_units, METH_VARARGS,
     "plan_units(keys, stored, heads, metas, namespace_id, raw_tables, below_frame_bytes, format, /) -> tuple[bytes, bytes]\n\n"
     "The kinds and stored checksums load_units needs for a chunk of a read's units (see _native_plan.c)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot native_slots[] = {
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ucm_db._native",
    .m_doc = "Compiled byte-plane shuffles for ucm_db's codec (see ucm_db.codec.native).",
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
