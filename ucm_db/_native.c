/* ucm_db._native: the hot loops of keys and codec, in C.
 *
 * Optional: ucm_db/native.py falls back to pure Python / numpy when this
 * module is not built, and tests/test_native.py checks that both give the
 * same bytes.
 *
 *   chain_keys(prev, tokens, block_size, n_blocks, start=0) -> list[bytes]
 *       key[i] = BLAKE2b-256(key[i-1] || little-endian uint32 token ids of
 *       block i), key[-1] = prev. BLAKE2b is written here from RFC 7693
 *       (unkeyed, digest length 32, no salt or personalisation).
 *   split_planes(src, element_bytes) -> list[bytearray]
 *       plane i holds byte i (least significant first) of each
 *       little-endian element; element_bytes is 2 or 4.
 *   merge_planes(planes, out, element_bytes) -> None
 *       the inverse, written straight into the caller's buffer.
 *   blake2b_256(data) -> bytes
 *       one digest, for checking this BLAKE2b against hashlib's.
 *
 * The GIL is released around the loops once their inputs are pinned, but
 * only for large calls: a release lets a waiting thread run, and getting the
 * GIL back can then take a whole switch interval (5 ms by default), far more
 * than hashing a few blocks.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Below this many bytes of work a call keeps the GIL (see above). */
#define RELEASE_GIL_BYTES ((Py_ssize_t)64 * 1024)

/* ------------------------------------------------------------------------
 * BLAKE2b (RFC 7693), 32-byte digest, no key.
 * ------------------------------------------------------------------------ */

#define B2B_BLOCK_BYTES 128
#define B2B_OUT_BYTES 32

/* RFC 7693 section 2.6: the SHA-512 initial hash value. */
static const uint64_t b2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* RFC 7693 section 2.7: message word schedule; rounds 10 and 11 repeat 0 and 1. */
static const uint8_t b2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

typedef struct {
    uint64_t h[8];
    uint64_t t0, t1;              /* 128-bit count of bytes hashed so far */
    uint8_t buf[B2B_BLOCK_BYTES]; /* pending input, not yet compressed */
    size_t buf_len;
} b2b_state;

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64_le(const uint8_t *p)
{
    /* gcc and clang turn this into one load on little-endian hosts. */
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

static inline void store64_le(uint8_t *p, uint64_t x)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(x >> (8 * i));
    }
}

/* The mixing function G (RFC 7693 section 3.1). */
#define B2B_G(a, b, c, d, x, y)         \
    do {                                \
        a = a + b + (x);                \
        d = rotr64(d ^ a, 32);          \
        c = c + d;                      \
        b = rotr64(b ^ c, 24);          \
        a = a + b + (y);                \
        d = rotr64(d ^ a, 16);          \
        c = c + d;                      \
        b = rotr64(b ^ c, 63);          \
    } while (0)

/* One round: columns, then diagonals; r is a constant so the schedule folds. */
#define B2B_ROUND(r)                                                            \
    do {                                                                        \
        const uint8_t *s = b2b_sigma[r];                                        \
        B2B_G(v0, v4, v8, v12, m[s[0]], m[s[1]]);                               \
        B2B_G(v1, v5, v9, v13, m[s[2]], m[s[3]]);                               \
        B2B_G(v2, v6, v10, v14, m[s[4]], m[s[5]]);                              \
        B2B_G(v3, v7, v11, v15, m[s[6]], m[s[7]]);                              \
        B2B_G(v0, v5, v10, v15, m[s[8]], m[s[9]]);                              \
        B2B_G(v1, v6, v11, v12, m[s[10]], m[s[11]]);                            \
        B2B_G(v2, v7, v8, v13, m[s[12]], m[s[13]]);                             \
        B2B_G(v3, v4, v9, v14, m[s[14]], m[s[15]]);                             \
    } while (0)

/* The compression function F (RFC 7693 section 3.2). */
static void b2b_compress(b2b_state *st, const uint8_t block[B2B_BLOCK_BYTES], int last)
{
    uint64_t m[16];
    for (int i = 0; i < 16; i++) {
        m[i] = load64_le(block + 8 * i);
    }
    uint64_t v0 = st->h[0], v1 = st->h[1], v2 = st->h[2], v3 = st->h[3];
    uint64_t v4 = st->h[4], v5 = st->h[5], v6 = st->h[6], v7 = st->h[7];
    uint64_t v8 = b2b_iv[0], v9 = b2b_iv[1], v10 = b2b_iv[2], v11 = b2b_iv[3];
    uint64_t v12 = b2b_iv[4] ^ st->t0, v13 = b2b_iv[5] ^ st->t1;
    uint64_t v14 = last ? ~b2b_iv[6] : b2b_iv[6], v15 = b2b_iv[7];
    B2B_ROUND(0);
    B2B_ROUND(1);
    B2B_ROUND(2);
    B2B_ROUND(3);
    B2B_ROUND(4);
    B2B_ROUND(5);
    B2B_ROUND(6);
    B2B_ROUND(7);
    B2B_ROUND(8);
    B2B_ROUND(9);
    B2B_ROUND(10);
    B2B_ROUND(11);
    st->h[0] ^= v0 ^ v8;
    st->h[1] ^= v1 ^ v9;
    st->h[2] ^= v2 ^ v10;
    st->h[3] ^= v3 ^ v11;
    st->h[4] ^= v4 ^ v12;
    st->h[5] ^= v5 ^ v13;
    st->h[6] ^= v6 ^ v14;
    st->h[7] ^= v7 ^ v15;
}

static void b2b_init(b2b_state *st)
{
    memcpy(st->h, b2b_iv, sizeof st->h);
    /* Parameter block word 0: digest length, key length 0, fanout 1, depth 1. */
    st->h[0] ^= 0x01010000ULL ^ B2B_OUT_BYTES;
    st->t0 = st->t1 = 0;
    st->buf_len = 0;
}

static inline void b2b_count(b2b_state *st, size_t n)
{
    st->t0 += (uint64_t)n;
    if (st->t0 < (uint64_t)n) {
        st->t1++;
    }
}

static void b2b_update(b2b_state *st, const uint8_t *data, size_t len)
{
    /* A full buffer is compressed only once more input arrives: the final
     * block must be compressed with the last-block flag set. */
    while (len > 0) {
        if (st->buf_len == B2B_BLOCK_BYTES) {
            b2b_count(st, B2B_BLOCK_BYTES);
            b2b_compress(st, st->buf, 0);
            st->buf_len = 0;
        }
        if (st->buf_len == 0) {
            while (len > B2B_BLOCK_BYTES) { /* whole blocks straight from the input */
                b2b_count(st, B2B_BLOCK_BYTES);
                b2b_compress(st, data, 0);
                data += B2B_BLOCK_BYTES;
                len -= B2B_BLOCK_BYTES;
            }
        }
        size_t take = B2B_BLOCK_BYTES - st->buf_len;
        if (take > len) {
            take = len;
        }
        memcpy(st->buf + st->buf_len, data, take);
        st->buf_len += take;
        data += take;
        len -= take;
    }
}

static void b2b_final(b2b_state *st, uint8_t out[B2B_OUT_BYTES])
{
    b2b_count(st, st->buf_len);
    memset(st->buf + st->buf_len, 0, B2B_BLOCK_BYTES - st->buf_len);
    b2b_compress(st, st->buf, 1);
    for (int i = 0; i < B2B_OUT_BYTES / 8; i++) {
        store64_le(out + 8 * i, st->h[i]);
    }
}

/* keys[i] = H(keys[i-1] || tokens[i * stride : (i + 1) * stride]), keys[-1] = prev. */
static void chain_hash(const uint8_t *prev, const uint8_t *tokens, size_t stride, size_t n_blocks, uint8_t *keys)
{
    for (size_t i = 0; i < n_blocks; i++) {
        b2b_state st;
        b2b_init(&st);
        b2b_update(&st, prev, B2B_OUT_BYTES);
        b2b_update(&st, tokens + i * stride, stride);
        b2b_final(&st, keys + i * B2B_OUT_BYTES);
        prev = keys + i * B2B_OUT_BYTES;
    }
}

/* ------------------------------------------------------------------------
 * Token ids -> little-endian uint32 bytes
 * ------------------------------------------------------------------------ */

#define TOO_LARGE "token id is greater than 2**32 - 1"

/* Same rules as array('I', ...): an int or an object with __index__;
 * OverflowError outside [0, 2**32), TypeError for anything else. */
static int token_value(PyObject *item, uint32_t *out)
{
    unsigned long value;
    if (PyLong_Check(item)) {
        value = PyLong_AsUnsignedLong(item);
    } else {
        PyObject *index = PyNumber_Index(item);
        if (index == NULL) {
            return -1;
        }
        value = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
    }
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (value > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, TOO_LARGE);
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

static inline void store32_le(uint8_t *p, uint32_t x)
{
    p[0] = (uint8_t)x;
    p[1] = (uint8_t)(x >> 8);
    p[2] = (uint8_t)(x >> 16);
    p[3] = (uint8_t)(x >> 24);
}

/* Converts the first `count` ids of a list or tuple into dst (4 * count bytes).
 * The caller checked that the sequence holds at least `count` items. */
static int sequence_to_le32(PyObject *seq, Py_ssize_t start, Py_ssize_t count, uint8_t *dst)
{
    PyObject **items = PySequence_Fast_ITEMS(seq) + start;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        uint32_t value;
        if (PyLong_CheckExact(item)) {
            /* The common case, kept lean: reading an exact int runs no Python code. */
            unsigned long wide = PyLong_AsUnsignedLong(item);
            if (wide >= 0xFFFFFFFFUL) { /* 2**32 - 1, too large, or an error (negative) */
                if (wide == (unsigned long)-1 && PyErr_Occurred()) {
                    return -1;
                }
                if (wide > 0xFFFFFFFFUL) {
                    PyErr_SetString(PyExc_OverflowError, TOO_LARGE);
                    return -1;
                }
            }
            value = (uint32_t)wide;
        } else {
            /* __index__ may run Python code that shrinks or reallocates a list. */
            Py_INCREF(item);
            int rc = token_value(item, &value);
            Py_DECREF(item);
            if (rc < 0) {
                return -1;
            }
            if (PySequence_Fast_GET_SIZE(seq) < start + count) {
                PyErr_SetString(PyExc_ValueError, "token list changed size during conversion");
                return -1;
            }
            items = PySequence_Fast_ITEMS(seq) + start;
        }
        store32_le(dst + 4 * i, value);
    }
    return 0;
}

/* True for buffer formats whose bytes are little-endian uint32 values. */
static int is_le_uint32_format(const char *fmt)
{
    if (strcmp(fmt, "<I") == 0) {
        return 1;
    }
#if PY_LITTLE_ENDIAN
    return strcmp(fmt, "I") == 0 || strcmp(fmt, "@I") == 0 || strcmp(fmt, "=I") == 0;
#else
    return 0;
#endif
}

static int is_byte_format(const char *fmt)
{
    return strcmp(fmt, "B") == 0 || strcmp(fmt, "b") == 0 || strcmp(fmt, "c") == 0 || strcmp(fmt, "@B") == 0 ||
           strcmp(fmt, "=B") == 0 || strcmp(fmt, "<B") == 0;
}

/* ------------------------------------------------------------------------
 * chain_keys
 * ------------------------------------------------------------------------ */

static PyObject *keys_to_list(const uint8_t *keys, Py_ssize_t n_blocks)
{
    PyObject *result = PyList_New(n_blocks);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)keys + i * B2B_OUT_BYTES, B2B_OUT_BYTES);
        if (key == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, i, key);
    }
    return result;
}

static PyObject *native_chain_keys(PyObject *module, PyObject *args)
{
    Py_buffer prev, tokens_view;
    PyObject *tokens;
    Py_ssize_t block_size, n_blocks, start = 0;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*Onn|n:chain_keys", &prev, &tokens, &block_size, &n_blocks, &start)) {
        return NULL;
    }
    PyObject *result = NULL;
    uint8_t *converted = NULL, *keys = NULL;
    int have_view = 0;

    if (prev.len != B2B_OUT_BYTES) {
        PyErr_Format(PyExc_ValueError, "prev must be %d bytes, got %zd", B2B_OUT_BYTES, prev.len);
        goto done;
    }
    if (block_size < 1 || n_blocks < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1, n_blocks and start >= 0");
        goto done;
    }
    if (n_blocks > PY_SSIZE_T_MAX / 4 / block_size || n_blocks > PY_SSIZE_T_MAX / B2B_OUT_BYTES) {
        PyErr_SetString(PyExc_OverflowError, "n_blocks * block_size is too large");
        goto done;
    }
    Py_ssize_t count = n_blocks * block_size;
    if (start > PY_SSIZE_T_MAX / 4 - count) {
        PyErr_SetString(PyExc_OverflowError, "start + n_blocks * block_size is too large");
        goto done;
    }
    const uint8_t *raw;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        if (PySequence_Fast_GET_SIZE(tokens) - start < count) {
            PyErr_Format(PyExc_ValueError, "tokens holds %zd ids, fewer than start + n_blocks * block_size = %zd",
                         PySequence_Fast_GET_SIZE(tokens), start + count);
            goto done;
        }
        converted = PyMem_Malloc(count > 0 ? (size_t)count * 4 : 1);
        if (converted == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (sequence_to_le32(tokens, start, count, converted) < 0) {
            goto done;
        }
        raw = converted;
    } else if (PyObject_CheckBuffer(tokens)) {
        if (PyObject_GetBuffer(tokens, &tokens_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto done;
        }
        have_view = 1;
        const char *fmt = tokens_view.format != NULL ? tokens_view.format : "B";
        if (!(tokens_view.itemsize == 1 && is_byte_format(fmt)) && !(tokens_view.itemsize == 4 && is_le_uint32_format(fmt))) {
            PyErr_Format(PyExc_TypeError, "tokens buffer must hold bytes or little-endian uint32, not format '%s'", fmt);
            goto done;
        }
        if (tokens_view.len / 4 - start < count) {
            PyErr_Format(PyExc_ValueError, "tokens buffer holds %zd bytes, fewer than 4 * (start + n_blocks * block_size) = %zd",
                         tokens_view.len, 4 * (start + count));
            goto done;
        }
        raw = (const uint8_t *)tokens_view.buf + 4 * start;
    } else {
        PyErr_Format(PyExc_TypeError, "tokens must be a list or tuple of ints or a uint32 buffer, not %.100s",
                     Py_TYPE(tokens)->tp_name);
        goto done;
    }

    keys = PyMem_Malloc(n_blocks > 0 ? (size_t)n_blocks * B2B_OUT_BYTES : 1);
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    size_t stride = (size_t)block_size * 4;
    if ((size_t)n_blocks * (B2B_OUT_BYTES + stride) >= (size_t)RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        chain_hash(prev.buf, raw, stride, (size_t)n_blocks, keys);
        Py_END_ALLOW_THREADS
    } else {
        chain_hash(prev.buf, raw, stride, (size_t)n_blocks, keys);
    }
    result = keys_to_list(keys, n_blocks);

done:
    PyMem_Free(keys);
    PyMem_Free(converted);
    if (have_view) {
        PyBuffer_Release(&tokens_view);
    }
    PyBuffer_Release(&prev);
    return result;
}

static PyObject *native_blake2b_256(PyObject *module, PyObject *args)
{
    Py_buffer data;
    uint8_t digest[B2B_OUT_BYTES];
    (void)module;
    if (!PyArg_ParseTuple(args, "y*:blake2b_256", &data)) {
        return NULL;
    }
    b2b_state st;
    b2b_init(&st);
    if (data.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        b2b_update(&st, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        b2b_update(&st, data.buf, (size_t)data.len);
    }
    b2b_final(&st, digest);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)digest, B2B_OUT_BYTES);
}

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

static void merge2(uint8_t *out, size_t n, const uint8_t *p0, const uint8_t *p1)
{
#if PY_LITTLE_ENDIAN
    for (size_t i = 0; i < n; i++) {
        uint16_t w = (uint16_t)(p0[i] | (uint16_t)p1[i] << 8);
        memcpy(out + 2 * i, &w, 2);
    }
#else
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = p0[i];
        out[2 * i + 1] = p1[i];
    }
#endif
}

static void merge4(uint8_t *out, size_t n, const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3)
{
#if PY_LITTLE_ENDIAN
    for (size_t i = 0; i < n; i++) {
        uint32_t w = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 | (uint32_t)p3[i] << 24;
        memcpy(out + 4 * i, &w, 4);
    }
#else
    for (size_t i = 0; i < n; i++) {
        out[4 * i] = p0[i];
        out[4 * i + 1] = p1[i];
        out[4 * i + 2] = p2[i];
        out[4 * i + 3] = p3[i];
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

static int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + b->len && b0 < a0 + a->len;
}

static PyObject *native_merge_planes(PyObject *module, PyObject *args)
{
    PyObject *planes_obj, *out_obj;
    int element_bytes;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOi:merge_planes", &planes_obj, &out_obj, &element_bytes)) {
        return NULL;
    }
    if (check_element_bytes(element_bytes) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(planes_obj, "planes must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer planes[4], out;
    int n_views = 0, have_out = 0;
    if (PySequence_Fast_GET_SIZE(seq) != element_bytes) {
        PyErr_Format(PyExc_ValueError, "got %zd planes for element_bytes %d", PySequence_Fast_GET_SIZE(seq), element_bytes);
        goto done;
    }
    for (; n_views < element_bytes; n_views++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, n_views), &planes[n_views], PyBUF_SIMPLE) < 0) {
            goto done;
        }
        if (planes[n_views].len != planes[0].len) {
            PyErr_Format(PyExc_ValueError, "plane %d holds %zd bytes, plane 0 %zd", n_views, planes[n_views].len,
                         planes[0].len);
            n_views++;
            goto done;
        }
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "out must be a writable contiguous buffer, not a read-only or strided %.100s",
                         Py_TYPE(out_obj)->tp_name);
        }
        goto done;
    }
    have_out = 1;
    Py_ssize_t n = planes[0].len;
    if (out.len != n * element_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes where %d planes of %zd need %zd", out.len, element_bytes, n,
                     n * element_bytes);
        goto done;
    }
    for (int i = 0; i < element_bytes; i++) {
        if (overlaps(&out, &planes[i])) {
            PyErr_SetString(PyExc_ValueError, "out overlaps a plane");
            goto done;
        }
    }
    if (out.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        merge_any(out.buf, (size_t)n, element_bytes, planes);
        Py_END_ALLOW_THREADS
    } else {
        merge_any(out.buf, (size_t)n, element_bytes, planes);
    }
    result = Py_NewRef(Py_None);

done:
    if (have_out) {
        PyBuffer_Release(&out);
    }
    for (int i = 0; i < n_views; i++) {
        PyBuffer_Release(&planes[i]);
    }
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------------------
 * Module
 * ------------------------------------------------------------------------ */

static PyMethodDef native_methods[] = {
    {"chain_keys", native_chain_keys, METH_VARARGS,
     "chain_keys(prev, tokens, block_size, n_blocks, start=0, /) -> list[bytes]\n\n"
     "Chained BLAKE2b-256 keys of n_blocks blocks of block_size uint32 token ids."},
    {"split_planes", native_split_planes, METH_VARARGS,
     "split_planes(src, element_bytes, /) -> list[bytearray]\n\n"
     "Byte planes of little-endian elements, least significant byte first."},
    {"merge_planes", native_merge_planes, METH_VARARGS,
     "merge_planes(planes, out, element_bytes, /) -> None\n\n"
     "Interleaves byte planes back into elements, written into out."},
    {"blake2b_256", native_blake2b_256, METH_VARARGS,
     "blake2b_256(data, /) -> bytes\n\nUnkeyed BLAKE2b with a 32-byte digest."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot native_slots[] = {
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ucm_db._native",
    .m_doc = "Compiled key chains and byte-plane shuffles for ucm_db (see ucm_db.native).",
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
