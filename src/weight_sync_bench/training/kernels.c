/* The training check's comparisons, each tensor read from memory once (kernels.py builds
 * this file at first use and says why). Every difference is taken in fp64 of the fp32
 * inputs, exactly as torch's `a.double() - b.double()` takes it, so the maxima are those of
 * the plain torch expressions to the bit; the sums of squares are reordered sums (four
 * lanes, two accumulators each), within 1e-12 of torch's. Built without
 * -ffast-math: NaN compares false and is tracked on its own, and nothing is reassociated
 * but what is written here.
 *
 * A tensor is `rows` rows of `cols` contiguous elements, row r at `x + r * ldx`: a whole
 * contiguous tensor is one row, a column slice of a matrix (a row-parallel weight's shard)
 * one row per matrix row. */

/* No header and no library call: a compiler without the C library's headers (a slim
 * image's bare gcc) builds it, and it links to nothing. The builtins are what math.h's
 * fabs and NAN, string.h's memcpy and stdint.h's int64_t compile to. */
typedef __INT64_TYPE__ int64_t;
#define INT64_MAX __INT64_MAX__
#define NAN __builtin_nan("")
#define fabs __builtin_fabs
#define memcpy __builtin_memcpy

typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));

static inline f64x4 load(const float *p)
{
    f32x4 v;
    memcpy(&v, p, sizeof v); /* unaligned */
    return __builtin_convertvector(v, f64x4);
}

static inline f64x4 magnitude(f64x4 x)
{
    const i64x4 sign_off = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    return (f64x4)((i64x4)x & sign_off);
}

/* lane by lane, x where x > m, else m: a NaN lane of x leaves m (NaN is counted apart) */
static inline f64x4 larger(f64x4 m, f64x4 x)
{
    i64x4 take = x > m;
    return (f64x4)(((i64x4)x & take) | ((i64x4)m & ~take));
}

/* the larger of two values neither of which is NaN */
static inline double max2(double x, double y)
{
    return y > x ? y : x;
}

static inline double lanes_max(f64x4 m)
{
    double out = 0.0;
    for (int k = 0; k < 4; k++)
        out = m[k] > out ? m[k] : out;
    return out;
}

/* out[0] = max |a - b| (NaN if any difference is NaN), out[1] = max |b| over the finite
 * comparisons (read only where out[0] is not NaN: then b holds no NaN either) */
void wsb_difference_and_magnitude(const float *a, int64_t lda, const float *b, int64_t ldb,
                                  int64_t rows, int64_t cols, double *out)
{
    f64x4 d0 = {0}, d1 = {0}, m0 = {0}, m1 = {0};
    i64x4 nan = {0};
    double d = 0.0, m = 0.0;
    int tail_nan = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = a + r * lda, *y = b + r * ldb;
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8) {
            f64x4 y0 = load(y + i), y1 = load(y + i + 4);
            f64x4 e0 = magnitude(load(x + i) - y0), e1 = magnitude(load(x + i + 4) - y1);
            nan |= (e0 != e0) | (e1 != e1);
            d0 = larger(d0, e0);
            d1 = larger(d1, e1);
            m0 = larger(m0, magnitude(y0));
            m1 = larger(m1, magnitude(y1));
        }
        for (; i < cols; i++) {
            double e = fabs((double)x[i] - (double)y[i]), f = fabs((double)y[i]);
            tail_nan |= e != e;
            d = e > d ? e : d;
            m = f > m ? f : m;
        }
    }
    for (int k = 0; k < 4; k++)
        tail_nan |= nan[k] != 0;
    d = max2(d, max2(lanes_max(d0), lanes_max(d1)));
    m = max2(m, max2(lanes_max(m0), lanes_max(m1)));
    out[0] = tail_nan ? NAN : d;
    out[1] = m;
}

/* out[0] = sum (a - b)^2, out[1] = sum (b - c)^2, in fp64 (NaN and inf as they come) */
void wsb_squared_differences(const float *a, int64_t lda, const float *b, int64_t ldb,
                             const float *c, int64_t ldc, int64_t rows, int64_t cols,
                             double *out)
{
    f64x4 s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};
    double s = 0.0, t = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = a + r * lda, *y = b + r * ldb, *z = c + r * ldc;
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8) {
            f64x4 y0 = load(y + i), y1 = load(y + i + 4);
            f64x4 p0 = load(x + i) - y0, p1 = load(x + i + 4) - y1;
            f64x4 q0 = y0 - load(z + i), q1 = y1 - load(z + i + 4);
            s0 += p0 * p0;
            s1 += p1 * p1;
            t0 += q0 * q0;
            t1 += q1 * q1;
        }
        for (; i < cols; i++) {
            double p = (double)x[i] - (double)y[i], q = (double)y[i] - (double)z[i];
            s += p * p;
            t += q * q;
        }
    }
    for (int k = 0; k < 4; k++) {
        s += s0[k] + s1[k];
        t += t0[k] + t1[k];
    }
    out[0] = s;
    out[1] = t;
}
