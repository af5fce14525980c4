/*
 * The request core: the C twin of orisha/core (connection.py, request.py,
 * negotiate.py, ranges.py, matcher.py, dates.py). The Python code is the
 * specification; comments below name the Python function each part mirrors,
 * and where C has to work differently (no big integers, fixed buffers, no
 * regular expressions) they say how the result stays the same. Both follow
 * the RFC grammar (numbers are 1*DIGIT, a weight is an RFC 9110 qvalue), so
 * neither imitates the other's language.
 *
 * Nothing of the policy is typed here: methods, error pages, fatal statuses,
 * default limits, token characters, the fields read, coding bits, the bounds of
 * several ranges, the bytes a Location keeps and the site image's record
 * layouts come from policy.h, which the build generates from the Python tables
 * (orisha/targets/unikernel/policy_header.py).
 *
 * Everything a response contains was decided by the build (the site image),
 * so answering is: frame the head, parse it strictly, pick records (a rule is
 * matched without regular expressions, from pieces), point segments at image
 * bytes. Only the Date/Connection tail, a 206 status block, a multipart's part
 * numbers and a rule's percent-encoded captures are formatted here; a
 * redirect's query and raw captures are copied from the head.
 */
#include <string.h>
#include "core.h"
#include "platform.h"

struct core_limits core_limits = {
#define CORE_LIMIT_DEFAULT(name, def, scale) .name = def,
    POLICY_LIMITS(CORE_LIMIT_DEFAULT)
#undef CORE_LIMIT_DEFAULT
};

/* ---- the site image (orisha/targets/unikernel/layout.py; layouts in policy.h) ---------- */

static const uint8_t *img;
static const struct image_header *H;
static const struct image_route *routes;
static const struct image_entry *entries;
static const struct image_error *errors;
static const struct image_rule *rules;

static const struct image_variant *variant_of(const struct image_entry *e, uint32_t i)
{
    return (const struct image_variant *)(img + e->variants_off) + i;
}

/* A table field's records (checked at boot: in the image, 4-aligned). */
#define TABLE(type, rec, f) ((const struct image_##type *)(img + (rec)->f##_off))

static void check_span(uint32_t off, uint32_t len, const char *what)
{
    if (len && ((uint64_t)off + len > H->size || off < IMAGE_HEADER_SIZE))
        PANIC("site image: %s out of bounds (%u+%u)", what, off, len);
}

static int table_fits(uint32_t off, uint32_t n, uint32_t size, size_t len)
{
    return !(off & 3) && (uint64_t)off + (uint64_t)size * n <= len;
}

/* Every span of record `rec` (the IMAGE_*_SPANS lists) inside the image. */
#define CHECK_SPAN(f) check_span(rec->f##_off, rec->f##_len, #f);
/* A table field of `rec` inside the image. */
#define CHECK_TABLE(f, type, what) \
    if (!table_fits(rec->f##_off, rec->f##_n, IMAGE_##type##_SIZE, H->size)) \
        PANIC("site image: bad %s table of %s", #f, what);

static void check_entries(void)
{
    for (uint32_t i = 0; i < H->entries_n; i++) {
        const struct image_entry *rec = &entries[i];
        if (!rec->variants_n || rec->identity >= rec->variants_n ||
            !table_fits(rec->variants_off, rec->variants_n, IMAGE_VARIANT_SIZE, H->size))
            PANIC("site image: bad entry %u", i);
        for (int m = 0; m < IMAGE_MASKS; m++)
            if (rec->choice[m] != IMAGE_NO_VARIANT && rec->choice[m] >= rec->variants_n)
                PANIC("site image: bad choice in entry %u", i);
        IMAGE_ENTRY_SPANS(CHECK_SPAN)
        for (uint32_t j = 0; j < rec->variants_n; j++) {
            const struct image_variant *rec = variant_of(&entries[i], j);
            IMAGE_VARIANT_SPANS(CHECK_SPAN)
        }
    }
}

static void check_indices(uint32_t off, uint32_t n)
{
    if (!table_fits(off, n, IMAGE_INDEX_SIZE, H->size))
        PANIC("site image: rule list out of bounds");
    for (uint32_t k = 0; k < n; k++)
        if (((const struct image_index *)(img + off))[k].rule >= H->rules_n)
            PANIC("site image: bad rule index");
}

/* `n` routes at `table`: `rules_too` allows rule lists and the kind "none". */
static void check_routes(const struct image_route *table, uint32_t n, int rules_too)
{
    for (uint32_t i = 0; i < n; i++) {
        const struct image_route *rec = &table[i];
        if (rec->kind == IMAGE_ROUTE_ENTRY ? rec->entry >= H->entries_n
            : rec->kind == IMAGE_ROUTE_NONE ? !rules_too
            : rec->kind != IMAGE_ROUTE_REDIRECT)
            PANIC("site image: bad route %u", i);
        if (rec->rules_n && !rules_too)
            PANIC("site image: rules in a rule's route %u", i);
        IMAGE_ROUTE_SPANS(CHECK_SPAN)
        check_indices(rec->rules_off, rec->rules_n);
    }
}

/* A rule's pieces: kinds of a pattern (`path`) or a destination, slots in range. The
 * longest destination a 200/404 rule builds (image._check_url) must fit URL_MAX. */
static uint64_t check_pieces(const struct image_rule *rule, const struct image_piece *p,
                             uint32_t n, int path)
{
    uint64_t most = 0;
    if (n > IMAGE_PIECES_MAX)
        PANIC("site image: a rule with %u pieces", n);
    for (uint32_t k = 0; k < n; k++) {
        const struct image_piece *rec = &p[k];
        int capture = rec->kind != IMAGE_PIECE_TEXT;
        int ok = path ? rec->kind <= IMAGE_PIECE_SPLAT
                      : rec->kind == IMAGE_PIECE_TEXT || rec->kind >= IMAGE_PIECE_QUOTED;
        if (!ok || (capture && rec->slot >= rule->slots))
            PANIC("site image: bad rule piece");
        IMAGE_PIECE_SPANS(CHECK_SPAN)
        most += !capture ? rec->text_len
              : (uint64_t)(CORE_TARGET_MAX + 1) * (rec->kind == IMAGE_PIECE_QUOTED ? 3 : 1);
    }
    return most;
}

static void check_rules(void)
{
    for (uint32_t i = 0; i < H->rules_n; i++) {
        const struct image_rule *rec = &rules[i];
        const char *what = "a rule";
        CHECK_TABLE(path, PIECE, what)
        CHECK_TABLE(to, PIECE, what)
        CHECK_TABLE(query, CONDITION, what)
        CHECK_TABLE(entries, ROUTE, what)
        IMAGE_RULE_SPANS(CHECK_SPAN)
        int redirect = rec->status != 200 && rec->status != 404;
        if (rec->slots > IMAGE_SLOTS_MAX || redirect != (rec->location_len > 0))
            PANIC("site image: bad rule %u", i);
        check_pieces(rec, TABLE(piece, rec, path), rec->path_n, 1);
        if (check_pieces(rec, TABLE(piece, rec, to), rec->to_n, 0) > IMAGE_URL_MAX && !redirect)
            PANIC("site image: rule %u builds more than %u bytes", i, IMAGE_URL_MAX);
        for (uint32_t k = 0; k < rec->query_n; k++) {
            const struct image_condition *rec2 = &TABLE(condition, rec, query)[k];
            if (rec2->slot != IMAGE_NONE && rec2->slot >= rec->slots)
                PANIC("site image: bad condition in rule %u", i);
            check_span(rec2->key_off, rec2->key_len, "key");
            check_span(rec2->literal_off, rec2->literal_len, "literal");
        }
        check_routes(TABLE(route, rec, entries), rec->entries_n, 0);
    }
}

static void check_records(void)
{
    const struct image_header *rec = H;
    IMAGE_HEADER_SPANS(CHECK_SPAN)
    if (H->delimiter_len < 2)
        PANIC("site image: no multipart delimiter");
    for (uint32_t i = 0; i < H->errors_n; i++) {
        const struct image_error *rec = &errors[i];
        IMAGE_ERROR_SPANS(CHECK_SPAN)
    }
    check_entries();
    check_routes(routes, H->routes_n, 1);
    check_indices(H->site_rules_off, H->site_rules_n);
    check_rules();
}

uint32_t core_init(const uint8_t *image, size_t len)
{
    /* The image was written by our own build, but a truncated or foreign blob
     * must stop the boot with a clear line, not serve garbage. */
    if (len < IMAGE_HEADER_SIZE || ((uintptr_t)image & 3))
        PANIC("site image missing or misaligned (%zu bytes): build with orisha build --loop unikernel", len);
    img = image;
    H = (const struct image_header *)image;
    if (H->magic != IMAGE_MAGIC)
        PANIC("site image: bad magic %#x (not an orisha site image)", H->magic);
    if (H->version != IMAGE_VERSION)
        PANIC("site image: version %u, this kernel reads version %u", H->version, IMAGE_VERSION);
    if (H->size != len)
        PANIC("site image: header says %u bytes, embedded %zu", H->size, len);
    const struct image_header *rec = H;
    CHECK_TABLE(routes, ROUTE, "the header")
    CHECK_TABLE(entries, ENTRY, "the header")
    CHECK_TABLE(errors, ERROR, "the header")
    CHECK_TABLE(rules, RULE, "the header")
    routes = TABLE(route, H, routes);
    entries = TABLE(entry, H, entries);
    errors = TABLE(error, H, errors);
    rules = TABLE(rule, H, rules);
    if (H->not_found >= H->entries_n || (H->fallback != IMAGE_NONE && H->fallback >= H->entries_n))
        PANIC("site image: bad not-found/fallback entry");
    /* Validate every record once at boot so the request path needs no checks. */
    check_records();
    for (unsigned k = 0; k < sizeof policy_error_pages / sizeof policy_error_pages[0]; k++) {
        uint32_t i = 0;
        while (i < H->errors_n && errors[i].status != policy_error_pages[k])
            i++;
        if (i == H->errors_n)
            PANIC("site image: no %u response", policy_error_pages[k]);
    }
    return H->routes_n;
}

static const struct image_error *error_for(uint32_t status)
{
    for (uint32_t i = 0; i < H->errors_n; i++)
        if (errors[i].status == status)
            return &errors[i];
    PANIC("no error response %u", status); /* checked in core_init */
}

/* ---- small helpers ---------------------------------------------------------- */

struct str { const uint8_t *p; size_t n; };

static const uint8_t *mem_chr(const uint8_t *p, int ch, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] == (uint8_t)ch)
            return p + i;
    return NULL;
}

static uint8_t lower(uint8_t ch)
{
    return ch >= 'A' && ch <= 'Z' ? ch + 32 : ch;
}

static int is_ows(uint8_t ch)
{
    return ch == ' ' || ch == '\t';
}

/* bytes.strip(): only SP and HT can occur in a validated field value. */
static struct str strip(struct str s)
{
    while (s.n && is_ows(s.p[0]))
        s.p++, s.n--;
    while (s.n && is_ows(s.p[s.n - 1]))
        s.n--;
    return s;
}

static int eq(struct str s, const char *lit)
{
    size_t n = strlen(lit);
    return s.n == n && memcmp(s.p, lit, n) == 0;
}

static int ieq(struct str s, const char *lit) /* lit is lower case */
{
    size_t n = strlen(lit);
    if (s.n != n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (lower(s.p[i]) != (uint8_t)lit[i])
            return 0;
    return 1;
}

static const uint8_t *find(const uint8_t *p, size_t n, const char *needle)
{
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (p[i] == (uint8_t)needle[0] && memcmp(p + i, needle, k) == 0)
            return p + i;
    return NULL;
}

/* request.decimal: 1*DIGIT (ASCII) as a number saturated at `cap` (at most
 * 10^18, so no step overflows); 0 if `s` is empty or holds anything else. */
static int decimal(struct str s, uint64_t cap, uint64_t *out)
{
    uint64_t v = 0;
    if (!s.n)
        return 0;
    for (size_t i = 0; i < s.n; i++) {
        if (s.p[i] < '0' || s.p[i] > '9')
            return 0;
        v = v * 10 + (uint64_t)(s.p[i] - '0');
        if (v > cap)
            v = cap;
    }
    *out = v;
    return 1;
}

static int in_list(struct str s, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (eq(s, list[i]))
            return 1;
    return 0;
}
#define IN_LIST(s, list) in_list(s, list, sizeof list / sizeof list[0])

/* ---- dates.py ---------------------------------------------------------------- */

static const char days_names[7][4] = { "Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed" };
static const char month_names[12][4] = { "Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                         "Jul", "Aug", "Sep", "Oct", "Nov", "Dec" };

/* Years are 1*DIGIT, so y >= -1 below, where C's division agrees with Python's //. */
static int64_t days_from_civil(int64_t y, int64_t m, int64_t d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* format_http_date for the Date header: always the present, so no negatives. */
static int format_http_date(char *out, uint64_t epoch)
{
    uint64_t days = epoch / 86400, secs = epoch % 86400;
    int64_t z = (int64_t)days + 719468;
    int64_t era = z / 146097;
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t y = yoe + era * 400;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    int64_t d = doy - (153 * mp + 2) / 5 + 1;
    int64_t m = mp < 10 ? mp + 3 : mp - 9;
    return platform_snprintf(out, 40, "%s, %02d %s %04d %02d:%02d:%02d GMT",
                             days_names[days % 7], (int)d, month_names[m - 1],
                             (int)(m <= 2 ? y + 1 : y), (int)(secs / 3600),
                             (int)(secs / 60 % 60), (int)(secs % 60));
}

static int clock_secs(struct str t, int64_t *out)
{
    if (t.n != 8 || t.p[2] != ':' || t.p[5] != ':')
        return 0;
    int v[3];
    for (int k = 0; k < 3; k++) {
        uint8_t a = t.p[3 * k], b = t.p[3 * k + 1];
        if (a < '0' || a > '9' || b < '0' || b > '9')
            return 0;
        v[k] = (a - '0') * 10 + (b - '0');
    }
    if (v[0] > 23 || v[1] > 59 || v[2] > 60)
        return 0;
    *out = v[0] * 3600 + v[1] * 60 + (v[2] > 59 ? 59 : v[2]);
    return 1;
}

static int epoch_of(int64_t y, struct str mon, int64_t d, struct str clock, int64_t *out)
{
    int m = 0;
    for (int i = 0; i < 12; i++)
        if (mon.n == 3 && memcmp(mon.p, month_names[i], 3) == 0)
            m = i + 1;
    int64_t secs;
    if (!m || !clock_secs(clock, &secs) || d < 1 || d > 31)
        return 0;
    *out = days_from_civil(y, m, d) * 86400 + secs;
    return 1;
}

/* dates._number: day and year saturate at dates.YEAR_MAX. */
static int date_number(struct str s, int64_t *out)
{
    uint64_t v;
    if (!decimal(s, POLICY_YEAR_MAX, &v))
        return 0;
    *out = (int64_t)v;
    return 1;
}

int core_parse_http_date(const uint8_t *p, size_t n, int64_t *out)
{
    struct str f[7];
    int k = 0;
    size_t i = 0;
    for (;;) { /* value.strip().split() */
        while (i < n && (is_ows(p[i]) || p[i] == '\r' || p[i] == '\n' || p[i] == 11 || p[i] == 12))
            i++;
        if (i >= n)
            break;
        if (k == 7)
            return 0; /* more than six fields: no form matches */
        size_t s = i;
        while (i < n && !(is_ows(p[i]) || p[i] == '\r' || p[i] == '\n' || p[i] == 11 || p[i] == 12))
            i++;
        f[k].p = p + s;
        f[k].n = i - s;
        k++;
    }
    int64_t y, d;
    if (k == 6 && f[0].p[f[0].n - 1] == ',' && eq(f[5], "GMT")) { /* IMF-fixdate */
        if (f[1].n != 2 || f[3].n != 4)
            return 0;
        if (!date_number(f[3], &y) || !date_number(f[1], &d))
            return 0;
        return epoch_of(y, f[2], d, f[4], out);
    }
    if (k == 4 && f[0].p[f[0].n - 1] == ',' && eq(f[3], "GMT")) { /* RFC 850 */
        const uint8_t *a = mem_chr(f[1].p, '-', f[1].n);
        if (!a)
            return 0;
        const uint8_t *b = mem_chr(a + 1, '-', f[1].p + f[1].n - (a + 1));
        if (!b || mem_chr(b + 1, '-', f[1].p + f[1].n - (b + 1)))
            return 0;
        struct str dd = { f[1].p, (size_t)(a - f[1].p) };
        struct str mon = { a + 1, (size_t)(b - a - 1) };
        struct str yy = { b + 1, (size_t)(f[1].p + f[1].n - b - 1) };
        if (!date_number(yy, &y))
            return 0;
        if (yy.n == 2)
            y += y >= 70 ? 1900 : 2000;
        if (!date_number(dd, &d))
            return 0;
        return epoch_of(y, mon, d, f[2], out);
    }
    if (k == 5) { /* asctime */
        if (!date_number(f[4], &y) || !date_number(f[2], &d))
            return 0;
        return epoch_of(y, f[1], d, f[3], out);
    }
    return 0;
}

/* ---- request.py: parse_head ----------------------------------------------------- */

/* Lines and list-field occurrences of one head: sized for the worst case (every
 * byte a line end) so that no head, however malformed, can overflow them. */
#define MAX_LINES (CORE_HEAD_MAX + 8)
struct occ { struct str v; uint8_t id; };

struct request {
    struct str method, path, query;
    int has_query;
    int minor;
    int present[FIELD_N];    /* single fields: 1 once, 2 repeated (value "") */
    struct str single[FIELD_SINGLE_N];
    uint32_t n_occ;
    int n_list[FIELD_N];
};

static struct occ occs[MAX_LINES]; /* one request is parsed at a time */
static struct str lines[MAX_LINES];

/* _lines: split on LF, drop one CR before it; any other CR is a bare CR.
 * Returns the number of lines, 0 for a bare CR. */
static size_t split_lines(const uint8_t *head, size_t n)
{
    size_t nl = 0, s = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i == n || head[i] == '\n') {
            size_t e = i;
            if (e > s && head[e - 1] == '\r')
                e--;
            if (mem_chr(head + s, '\r', e - s))
                return 0;
            ASSERT(nl < MAX_LINES);
            lines[nl].p = head + s;
            lines[nl].n = e - s;
            nl++;
            s = i + 1;
        }
    }
    return nl;
}

/* The request-line: exactly three parts split on single spaces, checked in
 * parse_head's order. 0 or the error status. */
static int request_line(struct str l0, struct str *method, struct str *target, int *minor)
{
    struct str part[3];
    int np = 0;
    size_t st = 0;
    for (size_t i = 0; i <= l0.n; i++) {
        if (i == l0.n || l0.p[i] == ' ') {
            if (np == 3)
                return 400;
            part[np].p = l0.p + st;
            part[np].n = i - st;
            np++;
            st = i + 1;
        }
    }
    if (np != 3)
        return 400;
    struct str version = part[2];
    *method = part[0], *target = part[1];
    /* The method first (as parse_head): what lets core_next refuse it early. */
    if (!method->n)
        return 400;
    for (size_t i = 0; i < method->n; i++)
        if (!policy_tchar[method->p[i]])
            return 400;
    if (version.n != 8 || memcmp(version.p, "HTTP/", 5) != 0 || version.p[6] != '.' ||
        version.p[5] < '0' || version.p[5] > '9' || version.p[7] < '0' || version.p[7] > '9')
        return 400;
    if (version.p[5] != '1')
        return 505;
    if (target->n > core_limits.target)
        return 414;
    if (!target->n)
        return 400;
    for (size_t i = 0; i < target->n; i++)
        if (target->p[i] <= 0x20 || target->p[i] == 0x7f)
            return 400;
    *minor = version.p[7] - '0';
    return 0;
}

/* One field the core reads (`id`): a single field keeps one value (identical
 * Content-Length repeats are one; other repeats of Host and Content-Length are
 * 400, of the rest invalid); a list field keeps its lines in order. */
static int keep_field(struct request *r, int id, struct str value)
{
    if (id >= FIELD_SINGLE_N) {
        occs[r->n_occ].v = value;
        occs[r->n_occ].id = (uint8_t)id;
        r->n_occ++;
        r->n_list[id]++;
    } else if (!r->present[id]) {
        r->present[id] = 1;
        r->single[id] = value;
    } else if (id == FIELD_CONTENT_LENGTH && r->single[id].n == value.n &&
               memcmp(r->single[id].p, value.p, value.n) == 0) {
        /* identical repeats are one value (RFC 9110 §8.6) */
    } else if (id == FIELD_HOST || id == FIELD_CONTENT_LENGTH) {
        return 400;
    } else {
        r->present[id] = 2; /* a repeated singleton: treated as absent */
        r->single[id].n = 0;
    }
    return 0;
}

/* The field lines after the request-line: 0 or 400. */
static int field_lines(size_t nl, struct request *r)
{
    for (size_t li = 1; li < nl; li++) {
        struct str l = lines[li];
        size_t i = 0;
        while (i < l.n && policy_tchar[l.p[i]])
            i++;
        if (i == 0 || i >= l.n || l.p[i] != ':')
            return 400; /* obs-fold, space before the colon, no colon */
        struct str name = { l.p, i };
        struct str value = { l.p + i + 1, l.n - i - 1 };
        for (size_t k = 0; k < value.n; k++) {
            uint8_t ch = value.p[k];
            if ((ch < 0x20 && ch != '\t') || ch == 0x7f)
                return 400;
        }
        int id = -1;
        for (int f = 0; f < FIELD_N; f++)
            if (ieq(name, policy_field_names[f]))
                id = f;
        if (id >= 0 && keep_field(r, id, strip(value)))
            return 400;
    }
    return 0;
}

/* The path and query of a target; absolute-form is reduced to its path (which
 * may lack its '/': see choose). 0 or 400. */
static int split_target(struct str target, int safe, struct request *r)
{
    if (target.p[0] != '/') {
        /* absolute-form: [Hh][Tt][Tt][Pp][Ss]?://[^/?#]* */
        size_t i = 0;
        int abs = target.n >= 7 && ieq((struct str){ target.p, 4 }, "http");
        if (abs) {
            i = 4;
            if (i < target.n && lower(target.p[i]) == 's')
                i++;
            abs = target.n >= i + 3 && memcmp(target.p + i, "://", 3) == 0;
            i += 3;
        }
        if (abs) {
            while (i < target.n && target.p[i] != '/' && target.p[i] != '?' && target.p[i] != '#')
                i++;
            target.p += i;
            target.n -= i;
            /* "" → "/"; "?q" → "/?q": the '/' is supplied by choose */
        } else if (safe) {
            return 400; /* authority-form and asterisk-form: only for CONNECT/OPTIONS */
        } else {
            target.n = 0;
        }
    }
    const uint8_t *q = mem_chr(target.p, '?', target.n);
    struct str path = { target.p, q ? (size_t)(q - target.p) : target.n };
    const uint8_t *h = mem_chr(path.p, '#', path.n);
    if (h)
        path.n = (size_t)(h - path.p);
    r->has_query = q != NULL;
    if (q)
        r->query = (struct str){ q + 1, (size_t)(target.p + target.n - q - 1) };
    r->path = path;
    return 0;
}

/* request.parse_head, step by step and in its order of checks. 0 or the error status. */
static int parse_head(const uint8_t *head, size_t n, struct request *r)
{
    memset(r, 0, sizeof *r);
    size_t nl = split_lines(head, n);
    if (!nl)
        return 400;
    struct str method, target;
    int status = request_line(lines[0], &method, &target, &r->minor);
    if (!status)
        status = field_lines(nl, r);
    if (status)
        return status;
    if (r->minor >= 1 && !r->present[FIELD_HOST])
        return 400; /* RFC 9112 §3.2 */
    r->method = method;
    return split_target(target, IN_LIST(method, policy_safe_methods), r);
}

/* ---- negotiate.py ------------------------------------------------------------- */

/* RFC 9110 §12.4.2 qvalue = ( "0" [ "." 0*3DIGIT ] ) / ( "1" [ "." 0*3("0") ] ),
 * in thousandths; -1 if `v` is not one. */
static int qvalue(struct str v)
{
    if (!v.n || (v.p[0] != '0' && v.p[0] != '1') || (v.n > 1 && v.p[1] != '.') || v.n > 5)
        return -1;
    int one = v.p[0] == '1', q = one * 1000, scale = 100;
    for (size_t i = 2; i < v.n; i++, scale /= 10) {
        if (v.p[i] < '0' || v.p[i] > '9' || (one && v.p[i] != '0'))
            return -1;
        q += (v.p[i] - '0') * scale;
    }
    return q;
}

/* _weight: the weight of a member whose parameters start at `semi` (1000 without
 * one), -1 if a weight is malformed: weight = OWS ";" OWS "q=" qvalue. */
static int weight(const uint8_t *semi, const uint8_t *end)
{
    int q = 1000;
    while (semi) { /* the last q= wins; any malformed q= drops the member */
        const uint8_t *p0 = semi + 1;
        semi = mem_chr(p0, ';', (size_t)(end - p0));
        struct str param = { p0, (size_t)((semi ? semi : end) - p0) };
        const uint8_t *eqs = mem_chr(param.p, '=', param.n);
        struct str name = { param.p, eqs ? (size_t)(eqs - param.p) : param.n };
        if (!ieq(strip(name), "q"))
            continue;
        struct str val = { eqs ? eqs + 1 : end, eqs ? (size_t)(param.p + param.n - eqs - 1) : 0 };
        while (val.n && is_ows(val.p[val.n - 1]))
            val.n--;
        q = lower(name.p[name.n - 1]) == 'q' ? qvalue(val) : -1; /* no space before "=" */
        if (q < 0)
            return -1;
    }
    return q;
}

/* The members of list field `id` over all its lines, in order: Python's joined
 * value split on ",". Start with a zeroed cursor; 0 when there are no more. */
struct cursor { uint32_t k; size_t pos; };
static int next_member(const struct request *r, int id, struct cursor *it, struct str *m)
{
    for (; it->k < r->n_occ; it->k++, it->pos = 0) {
        struct str v = occs[it->k].v;
        if (occs[it->k].id != id || it->pos > v.n)
            continue;
        const uint8_t *comma = mem_chr(v.p + it->pos, ',', v.n - it->pos);
        size_t end = comma ? (size_t)(comma - v.p) : v.n;
        *m = (struct str){ v.p + it->pos, end - it->pos };
        it->pos = end + 1;
        return 1;
    }
    return 0;
}

/* accept_encoding_mask over every Accept-Encoding line, in order (= the joined value). */
static int accept_encoding_mask(const struct request *r)
{
    if (!r->n_list[FIELD_ACCEPT_ENCODING])
        return CODING_IDENTITY;
    int named[IMAGE_MASKS] = { 0 }; /* by coding bit: 0 unset, 1 acceptable, -1 refused */
    int star = 0;
    struct cursor it = { 0, 0 };
    struct str m;
    while (next_member(r, FIELD_ACCEPT_ENCODING, &it, &m)) {
        const uint8_t *semi = mem_chr(m.p, ';', m.n);
        struct str token = strip((struct str){ m.p, semi ? (size_t)(semi - m.p) : m.n });
        int q = weight(semi, m.p + m.n);
        if (!token.n || q < 0)
            continue;
        if (eq(token, "*"))
            star = q > 0 ? 1 : -1;
        for (unsigned c = 0; c < sizeof policy_codings / sizeof policy_codings[0]; c++)
            if (ieq(token, policy_codings[c].token))
                named[policy_codings[c].bit] = q > 0 ? 1 : -1;
    }
    int mask = 0;
    for (int bit = 1; bit < IMAGE_MASKS; bit <<= 1) {
        int ok = named[bit];
        if (!ok)
            ok = star ? star : (bit == CODING_IDENTITY ? 1 : -1);
        if (ok > 0)
            mask |= bit;
    }
    return mask;
}

/* none_match: If-None-Match (weak comparison) against one ETag. */
static int none_match(const struct request *r, struct str etag)
{
    if (r->n_list[FIELD_IF_NONE_MATCH] == 1) { /* a joined list of several lines is never one tag or "*" */
        for (uint32_t k = 0; k < r->n_occ; k++) {
            if (occs[k].id != FIELD_IF_NONE_MATCH)
                continue;
            if ((occs[k].v.n == etag.n && memcmp(occs[k].v.p, etag.p, etag.n) == 0) ||
                eq(strip(occs[k].v), "*"))
                return 1;
        }
    }
    struct cursor it = { 0, 0 };
    struct str t;
    while (next_member(r, FIELD_IF_NONE_MATCH, &it, &t)) {
        t = strip(t);
        if (t.n >= 2 && t.p[0] == 'W' && t.p[1] == '/')
            t.p += 2, t.n -= 2;
        if (t.n == etag.n && memcmp(t.p, etag.p, etag.n) == 0)
            return 1;
    }
    return 0;
}

static int tokens_have(const struct request *r, int id, const char *tok)
{
    struct cursor it = { 0, 0 };
    struct str m;
    while (next_member(r, id, &it, &m))
        if (ieq(strip(m), tok))
            return 1;
    return 0;
}

/* Digit strings as numbers: -1, 0, 1 (leading zeros ignored; any length). */
static int num_cmp(struct str a, struct str b)
{
    while (a.n > 1 && a.p[0] == '0')
        a.p++, a.n--;
    while (b.n > 1 && b.p[0] == '0')
        b.p++, b.n--;
    if (a.n != b.n)
        return a.n < b.n ? -1 : 1;
    int c = memcmp(a.p, b.p, a.n);
    return c < 0 ? -1 : c > 0;
}

/* byte_range: 1 with [first, last], 0 to ignore (whole 200), -1 unsatisfiable. */
static int byte_range(struct str v, uint64_t length, uint64_t *first, uint64_t *last)
{
    /* bytes=([0-9]*)-([0-9]*): no whitespace inside (RFC 9110 §14.1.1) */
    if (v.n < 6 || memcmp(v.p, "bytes=", 6) != 0)
        return 0;
    const uint8_t *dash = mem_chr(v.p + 6, '-', v.n - 6);
    if (!dash)
        return 0;
    struct str a = { v.p + 6, (size_t)(dash - v.p - 6) };
    struct str b = { dash + 1, (size_t)(v.p + v.n - dash - 1) };
    uint64_t start = 0, end = 0; /* positions saturate far above any length */
    if ((a.n && !decimal(a, POLICY_RANGE_MAX, &start)) || (b.n && !decimal(b, POLICY_RANGE_MAX, &end)))
        return 0;
    if (a.n) {
        if (!b.n || end > length - 1)
            end = length - 1; /* length 0 is caught below: start >= 0 = length */
        if (b.n && num_cmp(b, a) < 0)
            return 0; /* invalid range-spec: ignore the header */
        if (start >= length)
            return -1;
        *first = start;
        *last = end;
        return 1;
    }
    if (!b.n)
        return 0;
    if (end == 0 || length == 0) /* a suffix-length */
        return -1;
    *first = end >= length ? 0 : length - end;
    *last = length - 1;
    return 1;
}

/* ---- ranges.py ----------------------------------------------------------------- */

struct part { uint64_t first, last; };

/* _num: digits (1*DIGIT, checked) as a number; more than RANGE_DIGITS of them
 * (leading zeros aside) count as RANGE_BIG, so no step overflows. */
static uint64_t range_num(struct str s)
{
    while (s.n && s.p[0] == '0')
        s.p++, s.n--;
    if (s.n > POLICY_RANGE_DIGITS)
        return POLICY_RANGE_BIG;
    uint64_t v = 0;
    for (size_t i = 0; i < s.n; i++)
        v = v * 10 + (uint64_t)(s.p[i] - '0');
    return v;
}

/* One element of the list, stripped and not empty: 1 with a range, 0 when it is
 * dropped (unsatisfiable), -1 when it makes the header invalid. */
static int range_spec(struct str el, uint64_t length, struct part *out)
{
    size_t dash = el.n;
    for (size_t i = 0; i < el.n; i++) { /* [0-9]*-[0-9]* */
        if (el.p[i] == '-' && dash == el.n)
            dash = i;
        else if (el.p[i] < '0' || el.p[i] > '9')
            return -1;
    }
    if (dash == el.n)
        return -1;
    struct str a = { el.p, dash }, b = { el.p + dash + 1, el.n - dash - 1 };
    if (a.n) {
        uint64_t start = range_num(a), end = b.n ? range_num(b) : POLICY_RANGE_BIG;
        if (end < start)
            return -1; /* an invalid range-spec makes the header invalid (§14.1.1) */
        if (start >= length)
            return 0;
        *out = (struct part){ start, end < length - 1 ? end : length - 1 };
        return 1;
    }
    if (!b.n)
        return -1; /* "-" alone */
    uint64_t suffix = range_num(b);
    if (suffix == 0 || length == 0)
        return 0;
    *out = (struct part){ suffix >= length ? 0 : length - suffix, length - 1 };
    return 1;
}

/* Heapsort by (first, last): a hostile list costs n log n, and needs no memory. */
static int part_less(const struct part *a, const struct part *b)
{
    return a->first != b->first ? a->first < b->first : a->last < b->last;
}

static void sift(struct part *v, size_t i, size_t n)
{
    for (size_t c; (c = 2 * i + 1) < n; i = c) {
        if (c + 1 < n && part_less(&v[c], &v[c + 1]))
            c++;
        if (!part_less(&v[i], &v[c]))
            return;
        struct part t = v[i];
        v[i] = v[c];
        v[c] = t;
    }
}

static void sort_parts(struct part *v, size_t n)
{
    for (size_t i = n / 2; i-- > 0;)
        sift(v, i, n);
    for (size_t end = n; end-- > 1;) {
        struct part t = v[0];
        v[0] = v[end];
        v[end] = t;
        sift(v, 0, end);
    }
}

/* Every element of a kept list has two bytes and a comma but the last. */
static struct part wanted[CORE_HEAD_MAX / 3 + 2];

/* range_set: the ranges of a Range value with a comma, sorted and merged into
 * parts[] (at most POLICY_RANGE_PARTS_MAX): 1 with *np parts, 0 to ignore the
 * header (the 200), -1 when none is satisfiable (416). */
static int range_set(struct str v, uint64_t length, struct part *parts, uint32_t *np)
{
    if (v.n < 6 || !ieq((struct str){ v.p, 6 }, "bytes=") || (v.n > 6 && is_ows(v.p[6])))
        return 0; /* OWS may stand around the commas only */
    size_t n = 0, s = 6;
    uint64_t asked = 0;
    for (size_t i = 6; i <= v.n; i++) {
        if (i < v.n && v.p[i] != ',')
            continue;
        struct str el = strip((struct str){ v.p + s, i - s });
        s = i + 1;
        if (!el.n)
            continue; /* RFC 9110 §5.6.1: empty list elements are ignored */
        ASSERT(n < sizeof wanted / sizeof wanted[0]);
        int k = range_spec(el, length, &wanted[n]);
        if (k < 0)
            return 0;
        if (k) {
            asked += wanted[n].last - wanted[n].first + 1;
            n++;
        }
    }
    if (!n)
        return -1;
    if (asked > length)
        return 0; /* overlapping abuse: the whole document instead */
    sort_parts(wanted, n);
    uint32_t m = 0;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        struct part *top = m ? &parts[m - 1] : NULL;
        if (top && wanted[i].first <= top->last + 1 + POLICY_RANGE_GAP) {
            total += wanted[i].last > top->last ? wanted[i].last - top->last : 0;
            if (wanted[i].last > top->last)
                top->last = wanted[i].last;
            continue;
        }
        if (m == POLICY_RANGE_PARTS_MAX)
            return 0; /* too many parts: the whole document */
        parts[m++] = wanted[i];
        total += wanted[i].last - wanted[i].first + 1;
    }
    if (total > POLICY_RANGE_BYTES_MAX)
        return 0;
    *np = m;
    return 1;
}

/* route_key: percent-decoding, dot segments, merged slashes. 0 if malformed. */
/* Sized for a rule's destination too (IMAGE_URL_MAX >= any request path). */
_Static_assert(IMAGE_URL_MAX >= CORE_TARGET_MAX + 2, "route_key buffers");
static uint8_t key_buf[IMAGE_URL_MAX];
static uint8_t seg_buf[IMAGE_URL_MAX];
static int route_key(struct str path, struct str *key)
{
    uint8_t *out = key_buf;
    size_t n = 0;
    if (mem_chr(path.p, '%', path.n)) {
        for (size_t i = 0; i < path.n; i++) {
            uint8_t ch = path.p[i];
            if (ch == '%') {
                int hv[2];
                for (int k = 0; k < 2; k++) {
                    uint8_t x = i + 1 + k < path.n ? path.p[i + 1 + k] : 0;
                    hv[k] = x >= '0' && x <= '9' ? x - '0' : (x | 32) >= 'a' && (x | 32) <= 'f' ? (x | 32) - 'a' + 10 : -1;
                    if (hv[k] < 0)
                        return 0;
                }
                ch = (uint8_t)(hv[0] * 16 + hv[1]);
                if (!ch)
                    return 0;
                i += 2;
            }
            out[n++] = ch;
        }
        path = (struct str){ out, n };
    }
    if (!find(path.p, path.n, "/.") && !find(path.p, path.n, "//")) {
        *key = path;
        return 1;
    }
    /* segments = path.split("/")[1:]; a stack of segments kept in seg_buf */
    size_t top = 0, nseg = 0;
    static uint32_t starts[IMAGE_URL_MAX / 2 + 1];
    size_t s = 1;
    struct str last = { 0, 0 };
    size_t total = 1;
    for (size_t i = 1; i <= path.n; i++) {
        if (i < path.n && path.p[i] != '/')
            continue;
        struct str seg = { path.p + s, i - s };
        s = i + 1;
        last = seg;
        total++;
        if (eq(seg, "..")) {
            if (nseg)
                top = starts[--nseg];
        } else if (!eq(seg, ".") && seg.n) {
            starts[nseg++] = (uint32_t)top;
            memcpy(seg_buf + top, seg.p, seg.n);
            top += seg.n;
            seg_buf[top++] = '/';
        }
    }
    /* key = "/" + "/".join(out) (+ "/" when the last segment was "", "." or "..") */
    size_t kn = 0;
    key_buf[kn++] = '/';
    memcpy(key_buf + kn, seg_buf, top);
    kn += top;
    int trailing = (last.n == 0 || eq(last, ".") || eq(last, "..")) && total > 1;
    if (nseg && !trailing)
        kn--; /* drop the separator after the last segment */
    *key = (struct str){ key_buf, kn };
    return 1;
}

/* A route of a table sorted by key (the site's, a 404 rule's destinations). */
static const struct image_route *lookup(const struct image_route *table, uint32_t n, struct str key)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        const struct image_route *r = &table[mid];
        size_t n = r->key_len < key.n ? r->key_len : key.n;
        int c = memcmp(img + r->key_off, key.p, n);
        if (!c)
            c = r->key_len < key.n ? -1 : r->key_len > key.n;
        if (!c)
            return r;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* ---- matcher.py ------------------------------------------------------------------ */

/* A matched rule's captures by slot (one request is answered at a time). They point
 * into the key (path placeholders) or into the request's query (query names). */
static struct str caps[IMAGE_SLOTS_MAX];

/* The pattern being matched, and the (piece, position) pairs known to fail: with no
 * back-references a failure does not depend on the captures before it, so each
 * pair is tried once and a pattern costs at most pieces x length^2 steps. */
static struct { const struct image_piece *p; uint32_t n; struct str s; size_t stride; } pat;
static uint8_t failed[IMAGE_PIECES_MAX * ((CORE_TARGET_MAX + 2) / 8 + 1)];

/* rule.pattern.fullmatch from piece i at position pos, as Python's re does it: a
 * capture takes the longest run first and gives back a byte at a time. */
static int match_from(uint32_t i, size_t pos)
{
    for (; i < pat.n; i++) {
        const struct image_piece *p = &pat.p[i];
        if (p->kind == IMAGE_PIECE_TEXT) {
            if (pat.s.n - pos < p->text_len || memcmp(pat.s.p + pos, img + p->text_off, p->text_len))
                return 0;
            pos += p->text_len;
            continue;
        }
        size_t most = pat.s.n - pos, bit = i * pat.stride * 8 + pos;
        if (p->kind == IMAGE_PIECE_SEGMENT) { /* [^/]+ */
            const uint8_t *slash = mem_chr(pat.s.p + pos, '/', most);
            if (slash)
                most = (size_t)(slash - (pat.s.p + pos));
        }
        if (failed[bit / 8] & (1u << (bit % 8)))
            return 0;
        for (size_t len = most + 1; len-- > (p->kind == IMAGE_PIECE_SEGMENT);) {
            caps[p->slot] = (struct str){ pat.s.p + pos, len };
            if (match_from(i + 1, pos + len))
                return 1;
        }
        failed[bit / 8] |= (uint8_t)(1u << (bit % 8));
        return 0;
    }
    return pos == pat.s.n;
}

static int match_path(const struct image_rule *rule, struct str key)
{
    pat.p = TABLE(piece, rule, path);
    pat.n = rule->path_n;
    pat.s = key;
    pat.stride = key.n / 8 + 1;
    ASSERT(pat.stride * pat.n <= sizeof failed);
    memset(failed, 0, pat.stride * pat.n);
    return match_from(0, 0);
}

/* _params: the first value of the raw query parameter `name` ("" without "="). */
static int query_param(const struct request *r, struct str name, struct str *value)
{
    if (!r->has_query)
        return 0;
    struct str q = r->query;
    size_t s = 0;
    for (size_t i = 0; i <= q.n && q.n; i++) {
        if (i < q.n && q.p[i] != '&')
            continue;
        struct str pair = { q.p + s, i - s };
        s = i + 1;
        const uint8_t *eqs = mem_chr(pair.p, '=', pair.n);
        size_t nn = eqs ? (size_t)(eqs - pair.p) : pair.n;
        if (nn == name.n && memcmp(pair.p, name.p, nn) == 0) {
            *value = eqs ? (struct str){ eqs + 1, pair.n - nn - 1 } : (struct str){ pair.p, 0 };
            return 1;
        }
    }
    return 0;
}

/* The query conditions of a rule whose path matched: each parameter present, equal
 * to its literal or bound to its slot. */
static int conditions_hold(const struct image_rule *rule, const struct request *r)
{
    for (uint32_t k = 0; k < rule->query_n; k++) {
        const struct image_condition *c = &TABLE(condition, rule, query)[k];
        struct str v;
        if (!query_param(r, (struct str){ img + c->key_off, c->key_len }, &v))
            return 0;
        if (c->slot != IMAGE_NONE)
            caps[c->slot] = v;
        else if (v.n != c->literal_len || memcmp(v.p, img + c->literal_off, v.n))
            return 0;
    }
    return 1;
}

/* match: the first of the rules listed at `list` matching the key and the query. */
static const struct image_rule *match_rules(uint32_t list_off, uint32_t n, struct str key,
                                            const struct request *r)
{
    const struct image_index *list = (const struct image_index *)(img + list_off);
    for (uint32_t k = 0; k < n; k++) {
        const struct image_rule *rule = &rules[list[k].rule];
        if (match_path(rule, key) && conditions_hold(rule, r))
            return rule;
    }
    return NULL;
}

/* _quote: a capture as a Location carries it (RFC 3986 pchar and "/"; the rest
 * percent-encoded, upper-case hex). Returns the bytes written. */
static size_t quote(struct str v, uint8_t *out)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = 0;
    for (size_t i = 0; i < v.n; i++) {
        if (policy_location_safe[v.p[i]]) {
            out[n++] = v.p[i];
        } else {
            out[n++] = '%';
            out[n++] = (uint8_t)hex[v.p[i] >> 4];
            out[n++] = (uint8_t)hex[v.p[i] & 15];
        }
    }
    return n;
}

/* The destination of a 200 or 404 rule up to its query (all route_key looks at),
 * built whole: image._check_url bounds it by IMAGE_URL_MAX. */
static uint8_t url_buf[IMAGE_URL_MAX];
static struct str rule_url(const struct image_rule *rule)
{
    static uint8_t quoted[3 * (CORE_TARGET_MAX + 2)];
    size_t n = 0;
    for (uint32_t k = 0; k < rule->to_n; k++) {
        const struct image_piece *p = &TABLE(piece, rule, to)[k];
        struct str v = p->kind == IMAGE_PIECE_TEXT ? (struct str){ img + p->text_off, p->text_len }
                                                   : caps[p->slot];
        if (p->kind == IMAGE_PIECE_QUOTED)
            v = (struct str){ quoted, quote(v, quoted) };
        const uint8_t *q = mem_chr(v.p, '?', v.n);
        size_t take = q ? (size_t)(q - v.p) : v.n;
        ASSERT(n + take <= sizeof url_buf);
        memcpy(url_buf + n, v.p, take);
        n += take;
        if (q)
            break;
    }
    return (struct str){ url_buf, n };
}

/* ---- connection.py ----------------------------------------------------------- */

enum { KEEP, CLOSE, KEEP10 }; /* App.tails kinds */
static uint64_t tails_second = ~0ull;
static char tails[3][64];
static uint8_t tails_len[3];

/* App.tails: formatted once per second, so Date is exact at no per-request cost. */
static void make_tail(struct core_conn *c, int kind)
{
    uint64_t second = platform_unix_time();
    if (second != tails_second) {
        char date[40];
        int n = format_http_date(date, second);
        ASSERT(n > 0 && n < 40);
        static const char *const ends[3] = { "\r\n", "Connection: close\r\n\r\n",
                                             "Connection: keep-alive\r\n\r\n" };
        for (int k = 0; k < 3; k++) {
            int m = platform_snprintf(tails[k], sizeof tails[k], "Date: %s\r\n%s", date, ends[k]);
            ASSERT(m > 0 && m < (int)sizeof tails[k]);
            tails_len[k] = (uint8_t)m;
        }
        tails_second = second;
    }
    /* Copied: a response may still be written when the shared tails change. */
    memcpy(c->tail, tails[kind], tails_len[kind]);
}

static void seg(struct core_conn *c, const void *p, size_t len, int copy)
{
    if (!len)
        return;
    if (!c->resp.n) /* a new plan: no stored block unless its planner names one */
        c->resp.h2_len = c->resp.h2_103_len = 0;
    ASSERT(c->resp.n < CORE_SEGS && len <= 0xffffffffu);
    c->resp.seg[c->resp.n++] = (struct core_seg){ p, (uint32_t)len, (uint8_t)copy };
}

/* The stored HTTP/2 header block (core_resp.h2) of the first `head` bytes of the plan
 * just started. */
static void stored_block(struct core_conn *c, uint32_t off, uint32_t len, size_t head)
{
    c->resp.h2 = img + off;
    c->resp.h2_len = len;
    c->resp.h2_head = (uint32_t)head;
}

/* _emit: head, Date/Connection tail, body; `fatal` drops the unparsed input.
 * `h2_off`/`h2_len`: the head's stored HTTP/2 block (0, 0: none). */
static void emit(struct core_conn *c, const uint8_t *head, size_t head_len, uint32_t h2_off,
                 uint32_t h2_len, int kind, const uint8_t *body, size_t body_len, int close,
                 int fatal)
{
    make_tail(c, kind);
    seg(c, head, head_len, 0);
    stored_block(c, h2_off, h2_len, head_len);
    seg(c, c->tail, tails_len[kind], 1);
    seg(c, body, body_len, 0);
    if (close) {
        c->close_after = 1;
        if (fatal)
            c->start = c->len = 0;
    }
}

static int is_fatal(int status)
{
    for (unsigned k = 0; k < sizeof policy_fatal / sizeof policy_fatal[0]; k++)
        if (policy_fatal[k] == status)
            return 1;
    return 0;
}

/* _error_plan(status, True) for the fatal statuses: close and drop the rest. */
static void emit_error(struct core_conn *c, int status)
{
    const struct image_error *e = error_for((uint32_t)status);
    ASSERT(is_fatal(status));
    emit(c, img + e->head_off, e->head_len, e->h2_off, e->h2_len, CLOSE, img + e->body_off,
         e->body_len, 1, 1);
    c->discard = 0;
}

static int if_range(const struct request *r, const struct image_entry *e, int64_t lm)
{
    if (!r->present[FIELD_IF_RANGE])
        return 1;
    struct str v = r->single[FIELD_IF_RANGE];
    if (v.n && v.p[0] == '"') {
        const struct image_variant *id = variant_of(e, e->identity);
        return v.n == id->etag_len && memcmp(v.p, img + id->etag_off, v.n) == 0;
    }
    int64_t t;
    return core_parse_http_date(v.p, v.n, &t) && t == lm;
}

/* _framing: 0 with the Date/Connection tail kind, whether to close after the
 * response and the body to discard; else the error status. */
static int framing(struct core_conn *c, const struct request *r, int *kind, int *close)
{
    uint64_t discard = 0;
    if (r->n_list[FIELD_TRANSFER_ENCODING]) {
        /* RFC 9112 §6.1/§6.3: TE with CL is smuggling; chunked → 411; other codings → 400 */
        if (r->present[FIELD_CONTENT_LENGTH] || r->minor == 0)
            return 400;
        struct cursor it = { 0, 0 };
        struct str m, last = { 0, 0 };
        while (next_member(r, FIELD_TRANSFER_ENCODING, &it, &m))
            last = m;
        return ieq(strip(last), "chunked") ? 411 : 400;
    }
    if (r->present[FIELD_CONTENT_LENGTH]) {
        /* RFC 9110 §8.6: 1*DIGIT; more than 18 digits is 400 (_framing) */
        struct str cl = r->single[FIELD_CONTENT_LENGTH];
        if (cl.n > 18 || !decimal(cl, core_limits.body + 1, &discard))
            return 400;
        if (discard > core_limits.body)
            return 413;
    }
    if (r->minor >= 1) {
        *close = tokens_have(r, FIELD_CONNECTION, "close");
        *kind = *close ? CLOSE : KEEP;
    } else if (tokens_have(r, FIELD_CONNECTION, "keep-alive")) {
        *kind = KEEP10, *close = 0;
    } else {
        *kind = CLOSE, *close = 1;
    }
    c->discard = discard;
    return 0;
}

/* What answers a request (connection.answer's `target`): an entry, a redirect
 * route, or a rule's redirect (its captures in caps). */
struct target {
    const struct image_entry *entry;
    const struct image_route *route;
    const struct image_rule *rule;
};

/* Whether the extension of key's last segment is one the header's assets list
 * ("/js/css/png/", lower case) names: ASCII case folded, as bytes.lower(). */
static int asset_extension(struct str key)
{
    size_t dot = key.n, i = key.n;
    while (i && key.p[i - 1] != '/') {
        i--;
        if (key.p[i] == '.' && dot == key.n)
            dot = i;
    }
    if (dot == key.n)
        return 0;
    size_t n = key.n - dot - 1;
    const uint8_t *list = img + H->assets_off;
    for (size_t at = 0; at + n + 2 <= H->assets_len; at++) {
        if (list[at] != '/' || list[at + n + 1] != '/')
            continue;
        size_t k = 0;
        while (k < n && lower(key.p[dot + 1 + k]) == list[at + 1 + k])
            k++;
        if (k == n)
            return 1;
    }
    return 0;
}

/* connection.unknown: the fallback for a navigation, else the not-found document. Not a
 * navigation: a Sec-Fetch-Dest naming another destination, or a path ending in one of
 * the site's non-HTML extensions (when the header says navigations only). */
static const struct image_entry *fallback_or_not_found(const struct request *r, struct str key)
{
    if (H->fallback == IMAGE_NONE)
        return &entries[H->not_found];
    if (!H->navigations)
        return &entries[H->fallback];
    struct str dest = r->single[FIELD_SEC_FETCH_DEST];
    if (r->present[FIELD_SEC_FETCH_DEST] == 1 && dest.n) {
        size_t k = 0, n = sizeof policy_navigation_dests / sizeof policy_navigation_dests[0];
        while (k < n && !eq(dest, policy_navigation_dests[k]))
            k++;
        if (k == n)
            return &entries[H->not_found];
    }
    return &entries[asset_extension(key) ? H->not_found : H->fallback];
}

/* A route's own answer (a Rules route's default); `none` when it has none. */
static void route_answer(const struct image_route *rt, const struct image_entry *none,
                         struct target *t)
{
    if (rt && rt->kind == IMAGE_ROUTE_REDIRECT)
        t->route = rt;
    else
        t->entry = rt && rt->kind == IMAGE_ROUTE_ENTRY ? &entries[rt->entry] : none;
}

/* matcher._target: a redirect is built when answered; a 200 rewrite answers as the
 * destination's route (a Rules route by its default), a 404 rule with the document
 * it lists for the destination; else the not-found document. */
static void rule_answer(const struct image_rule *rule, struct target *t)
{
    if (rule->location_len) {
        t->rule = rule;
        return;
    }
    struct str key;
    int ok = route_key(rule_url(rule), &key);
    const struct image_entry *nf = &entries[H->not_found];
    if (rule->status == 404) {
        const struct image_route *rt = ok ? lookup(TABLE(route, rule, entries), rule->entries_n, key) : NULL;
        t->entry = rt ? &entries[rt->entry] : nf;
    } else {
        route_answer(ok ? lookup(routes, H->routes_n, key) : NULL, nf, t);
    }
}

/* Routing: the route table by the path as sent, then by its key; the run-time rules
 * on a miss, a Rules route's own rules first. 0 for a malformed path (400). */
static int choose(const struct request *r, struct target *t)
{
    /* After absolute-form the path may lack its '/': put it back (parse_head does). */
    struct str path = r->path;
    static uint8_t slash_path[CORE_TARGET_MAX + 2];
    if (!path.n || path.p[0] != '/') {
        slash_path[0] = '/';
        memcpy(slash_path + 1, path.p, path.n);
        path = (struct str){ slash_path, path.n + 1 };
    }
    *t = (struct target){ 0 };
    struct str key = path;
    const struct image_route *rt = lookup(routes, H->routes_n, path);
    if (!rt) {
        if (!route_key(path, &key))
            return 0;
        rt = lookup(routes, H->routes_n, key);
    }
    const struct image_rule *rule = rt ? match_rules(rt->rules_off, rt->rules_n, key, r)
                                       : match_rules(H->site_rules_off, H->site_rules_n, key, r);
    if (rule)
        rule_answer(rule, t);
    else
        route_answer(rt, fallback_or_not_found(r, key), t);
    return 1;
}

/* A redirect: its Location (a route's, or a rule's destination with the captures,
 * percent-encoded into dyn once each), "?" + the query when it passes it on, its
 * tail. The query and raw captures are copied from the head in the input buffer. */
static void emit_redirect(struct core_conn *c, const struct request *r, const struct target *t,
                          int kind, int close)
{
    const struct image_rule *rule = t->rule;
    make_tail(c, kind);
    seg(c, img + (rule ? rule->location_off : t->route->location_off),
        rule ? rule->location_len : t->route->location_len, 0);
    struct str quoted[IMAGE_SLOTS_MAX] = { { 0, 0 } };
    size_t used = 0;
    for (uint32_t k = 0; rule && k < rule->to_n; k++) {
        const struct image_piece *p = &TABLE(piece, rule, to)[k];
        if (p->kind == IMAGE_PIECE_TEXT) {
            seg(c, img + p->text_off, p->text_len, 0);
        } else if (p->kind == IMAGE_PIECE_RAW) {
            seg(c, caps[p->slot].p, caps[p->slot].n, 1);
        } else {
            if (!quoted[p->slot].p) {
                ASSERT(used + 3 * caps[p->slot].n <= sizeof c->dyn);
                quoted[p->slot] = (struct str){ (uint8_t *)c->dyn + used,
                                                quote(caps[p->slot], (uint8_t *)c->dyn + used) };
                used += quoted[p->slot].n;
            }
            seg(c, quoted[p->slot].p, quoted[p->slot].n, 1);
        }
    }
    if (r->has_query && ((rule ? rule->flags : t->route->flags) & IMAGE_ROUTE_QUERY)) {
        seg(c, "?", 1, 0);
        seg(c, r->query.p, r->query.n, 1);
    } else if (!rule) { /* the head is the route's own: location and tail */
        stored_block(c, t->route->h2_off, t->route->h2_len,
                     (size_t)t->route->location_len + t->route->tail_len);
    }
    seg(c, img + (rule ? rule->tail_off : t->route->tail_off),
        rule ? rule->tail_len : t->route->tail_len, 0);
    seg(c, c->tail, tails_len[kind], 1);
    if (close)
        c->close_after = 1;
}

/* A single-part 206: status block in dyn, the identity fields, the bytes. */
static void emit_206(struct core_conn *c, const struct image_variant *id, uint64_t first,
                     uint64_t last, int kind, int close)
{
    int m = platform_snprintf(c->dyn, sizeof c->dyn,
                              "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %lu-%lu/%lu\r\n"
                              "Content-Length: %lu\r\n",
                              (unsigned long)first, (unsigned long)last,
                              (unsigned long)id->body_len, (unsigned long)(last - first + 1));
    ASSERT(m > 0 && m < (int)sizeof c->dyn);
    make_tail(c, kind);
    seg(c, c->dyn, (size_t)m, 1);
    seg(c, img + id->fields_off, id->fields_len, 0);
    seg(c, c->tail, tails_len[kind], 1);
    seg(c, img + id->body_off + first, last - first + 1, 0);
    if (close)
        c->close_after = 1;
}

/* A multipart/byteranges 206 (connection._ranges, ranges.multipart), streamed: each
 * part is its delimiter, the entry's part head, "FIRST-LAST/LENGTH" and a blank
 * line (formatted into dyn), and its bytes straight from the image. */
static void emit_multipart(struct core_conn *c, const struct image_entry *e,
                           const struct part *parts, uint32_t n, int kind, int close)
{
    const struct image_variant *id = variant_of(e, e->identity);
    struct str nums[POLICY_RANGE_PARTS_MAX];
    size_t at = 0;
    uint64_t body = H->close_delimiter_len;
    for (uint32_t i = 0; i < n; i++) {
        int m = platform_snprintf(c->dyn + at, sizeof c->dyn - at, "%lu-%lu/%lu\r\n\r\n",
                                  (unsigned long)parts[i].first, (unsigned long)parts[i].last,
                                  (unsigned long)id->body_len);
        ASSERT(m > 0 && (size_t)m < sizeof c->dyn - at);
        nums[i] = (struct str){ (uint8_t *)c->dyn + at, (size_t)m };
        at += (size_t)m;
        body += H->delimiter_len - (i ? 0 : 2) + e->part_type_len + (uint64_t)m +
                parts[i].last - parts[i].first + 1;
    }
    int m = platform_snprintf(c->dyn + at, sizeof c->dyn - at, "%lu\r\n", (unsigned long)body);
    ASSERT(m > 0 && (size_t)m < sizeof c->dyn - at);
    make_tail(c, kind);
    seg(c, img + H->multi_head_off, H->multi_head_len, 0);
    seg(c, c->dyn + at, (size_t)m, 1);
    seg(c, img + e->multi_fields_off, e->multi_fields_len, 0);
    seg(c, c->tail, tails_len[kind], 1);
    for (uint32_t i = 0; i < n; i++) {
        seg(c, img + H->delimiter_off + (i ? 0 : 2), H->delimiter_len - (i ? 0 : 2), 0);
        seg(c, img + e->part_type_off, e->part_type_len, 0);
        seg(c, nums[i].p, nums[i].n, 1);
        seg(c, img + id->body_off + parts[i].first, parts[i].last - parts[i].first + 1, 0);
    }
    seg(c, img + H->close_delimiter_off, H->close_delimiter_len, 0);
    if (close)
        c->close_after = 1;
}

/* The Range part of _conditional (If-Range passed): 1 if a 206 or 416 was planned,
 * 0 for the 200. A value with a comma is a list (_ranges), else one range. */
static int answer_range(struct core_conn *c, const struct request *r, const struct image_entry *e,
                        int kind, int close)
{
    const struct image_variant *id = variant_of(e, e->identity);
    struct str v = r->single[FIELD_RANGE];
    static struct part parts[POLICY_RANGE_PARTS_MAX];
    uint32_t n = 1;
    int got = mem_chr(v.p, ',', v.n) ? range_set(v, id->body_len, parts, &n)
                                     : byte_range(v, id->body_len, &parts[0].first, &parts[0].last);
    if (got < 0)
        emit(c, img + e->head_416_off, e->head_416_len, e->h2_416_off, e->h2_416_len, kind,
             NULL, 0, close, 0);
    else if (got && n == 1)
        emit_206(c, id, parts[0].first, parts[0].last, kind, close);
    else if (got)
        emit_multipart(c, e, parts, n, kind, close);
    return got != 0;
}

/* _conditional: a 304, 206 or 416 if one was planned (1), else 0 for the 200. */
static int conditional(struct core_conn *c, const struct request *r, const struct image_entry *e,
                       const struct image_variant *v, int ranged, int kind, int close)
{
    int64_t lm = (int64_t)((uint64_t)e->last_modified_hi << 32 | e->last_modified_lo);
    struct str ims = r->single[FIELD_IF_MODIFIED_SINCE];
    int64_t t;
    if (r->n_list[FIELD_IF_NONE_MATCH] ? none_match(r, (struct str){ img + v->etag_off, v->etag_len })
        : r->present[FIELD_IF_MODIFIED_SINCE] && ims.n && core_parse_http_date(ims.p, ims.n, &t) && lm <= t) {
        emit(c, img + v->head_304_off, v->head_304_len, v->h2_304_off, v->h2_304_len, kind,
             NULL, 0, close, 0);
        return 1;
    }
    if (!ranged || !r->present[FIELD_RANGE] || !r->single[FIELD_RANGE].n || !if_range(r, e, lm))
        return 0;
    return answer_range(c, r, e, kind, close);
}

/* The entry's answer: negotiation (406), conditionals and ranges, else its 200. */
static void answer_entry(struct core_conn *c, const struct request *r, const struct image_entry *e,
                         int get, int kind, int close)
{
    int mask = accept_encoding_mask(r);
    if (e->choice[mask] == IMAGE_NO_VARIANT) {
        const struct image_error *er = error_for(406);
        emit(c, img + er->head_off, er->head_len, er->h2_off, er->h2_len, kind, img + er->body_off,
             get ? er->body_len : 0, close, 0);
        return;
    }
    const struct image_variant *v = variant_of(e, e->choice[mask]);
    if ((e->flags & IMAGE_ENTRY_CONDITIONAL) &&
        conditional(c, r, e, v, get && (mask & CODING_IDENTITY), kind, close))
        return;
    emit(c, img + v->head_off, v->head_len, v->h2_off, v->h2_len, kind, img + v->body_off,
         get ? v->body_len : 0, close, 0);
    c->resp.h2_103 = img + v->h2_103_off; /* after emit: its first seg() cleared it */
    c->resp.h2_103_len = v->h2_103_len;
}

/* answer(): the response for one complete head (without its final empty line). */
static void answer(struct core_conn *c, const uint8_t *head, size_t n)
{
    static struct request req;
    struct request *r = &req;
    int kind = CLOSE, close = 1;
    int status = parse_head(head, n, r);
    if (!status)
        status = framing(c, r, &kind, &close);
    if (status) {
        emit_error(c, status);
        return;
    }
    if (!IN_LIST(r->method, policy_safe_methods)) {
        const struct image_error *e = error_for(IN_LIST(r->method, policy_known_methods) ? 405 : 501);
        emit(c, img + e->head_off, e->head_len, e->h2_off, e->h2_len, kind, img + e->body_off,
             e->body_len, close, 0);
        return;
    }
    struct target t;
    if (!choose(r, &t)) {
        emit_error(c, 400);
        return;
    }
    if (t.entry)
        answer_entry(c, r, t.entry, eq(r->method, "GET"), kind, close);
    else
        emit_redirect(c, r, &t, kind, close);
}

void core_connect(struct core_conn *c, uint64_t now_ms, uint32_t open)
{
    c->start = c->len = 0;
    c->discard = 0;
    c->since = now_ms;
    c->eof = c->close_after = 0;
    c->resp.n = 0;
    if (open > core_limits.connections)
        emit_error(c, 503);
}

int core_wants_input(const struct core_conn *c)
{
    /* Python reads only while nothing is pending; here the glue may hold more
     * input, but the buffer must have room (or a body to skip). */
    return !c->close_after && (c->discard || c->len - c->start < core_limits.head + 4);
}

size_t core_take(struct core_conn *c, const uint8_t *data, size_t n)
{
    size_t used = 0;
    if (c->close_after)
        return n; /* nothing more will be answered: drop (Python leaves it unread) */
    if (c->discard && c->start == c->len) {
        size_t skip = c->discard < n ? (size_t)c->discard : n;
        c->discard -= skip;
        used = skip;
    }
    if (c->discard)
        return used;
    uint32_t cap = core_limits.head + 4;
    if (c->start && c->len + (n - used) > cap) { /* compact */
        memmove(c->buf, c->buf + c->start, c->len - c->start);
        c->len -= c->start;
        c->start = 0;
    }
    size_t room = cap > c->len ? cap - c->len : 0;
    size_t k = n - used < room ? n - used : room;
    memcpy(c->buf + c->len, data + used, k);
    c->len += (uint32_t)k;
    return used + k;
}

/* Out of input: at EOF the peer sent all it will, so what it asked for is
 * queued and the connection ends (a partial head is never answered). */
static int need_input(struct core_conn *c)
{
    if (c->eof)
        c->close_after = 1;
    return 0;
}

/* request.cannot_begin: a head with no end yet whose method (the bytes before
 * the first SP) is empty or holds a non-tchar can only be a 400. */
static int cannot_begin(const uint8_t *buf, size_t n)
{
    size_t i = 0;
    while (i < n && policy_tchar[buf[i]])
        i++;
    return i < n && (i == 0 || buf[i] != ' ');
}

/* Where the head at `buf` ends: 1 with the end of its last field line and the
 * start of what follows, 0 if no end is within `lim` bytes. Exactly _process's
 * two-step search: "\r\n\r\n" first; the lenient \r?\n\r?\n only when that
 * finds nothing or the head holds a bare-LF end. */
static int head_end(const uint8_t *buf, size_t lim, size_t *end, size_t *rest)
{
    const uint8_t *f = find(buf, lim, "\r\n\r\n");
    if (f && !find(buf, (size_t)(f - buf), "\n\n") && !find(buf, (size_t)(f - buf), "\n\r\n")) {
        *end = (size_t)(f - buf);
        *rest = *end + 4;
        return 1;
    }
    for (size_t i = 0; i < lim; i++) {
        size_t j = i;
        if (buf[j] == '\r')
            j++;
        if (j >= lim || buf[j] != '\n')
            continue;
        j++;
        if (j + 1 < lim && buf[j] == '\r' && buf[j + 1] == '\n')
            j += 2;
        else if (j < lim && buf[j] == '\n')
            j++;
        else
            continue;
        *end = i;
        *rest = j;
        return 1;
    }
    return 0;
}

int core_next(struct core_conn *c, uint64_t now_ms)
{
    ASSERT(c->resp.n == 0);
    if (c->close_after)
        return 0;
    if (c->discard) {
        size_t have = c->len - c->start;
        size_t skip = c->discard < have ? (size_t)c->discard : have;
        c->discard -= skip;
        c->start += (uint32_t)skip;
        if (c->discard)
            return need_input(c);
    }
    /* RFC 9112 §2.2: ignore empty lines received before a request-line. */
    while (c->start < c->len && (c->buf[c->start] == '\r' || c->buf[c->start] == '\n'))
        c->start++;
    if (c->start == c->len) {
        c->start = c->len = 0;
        return need_input(c);
    }
    const uint8_t *buf = c->buf + c->start;
    size_t have = c->len - c->start, limit = core_limits.head;
    size_t lim = have < limit + 4 ? have : limit + 4, end, rest;
    if (!head_end(buf, lim, &end, &rest)) {
        if (cannot_begin(buf, lim)) { /* e.g. a TLS ClientHello: 400 at once */
            emit_error(c, 400);
            return 1;
        }
        if (have > limit) {
            emit_error(c, mem_chr(buf, '\n', limit) ? 431 : 414);
            return 1;
        }
        return need_input(c);
    }
    c->start += (uint32_t)rest;
    c->since = now_ms;
    answer(c, buf, end);
    /* The head bytes stay valid until the next take: segments point into the
     * image, the connection's tail/dyn copies or (copied) the head itself. */
    return 1;
}

void core_eof(struct core_conn *c)
{
    c->eof = 1;
}

void core_sent(struct core_conn *c, uint64_t now_ms)
{
    c->since = now_ms;
}

int core_tick(struct core_conn *c, uint64_t now_ms, int writing)
{
    uint64_t waited = now_ms - c->since;
    if (writing || c->resp.n)
        return waited > core_limits.send_timeout;
    if (c->len > c->start || c->discard) {
        if (waited > core_limits.head_timeout && !c->close_after)
            emit_error(c, 408);
        return 0;
    }
    return waited > core_limits.idle_timeout;
}

int core_done(const struct core_conn *c)
{
    return c->close_after && !c->resp.n;
}

void core_refuse(struct core_conn *c, const void *head, size_t head_len,
                 const void *body, size_t body_len)
{
    c->resp.n = 0; /* a 503 planned at connect is not sent */
    emit(c, head, head_len, 0, 0, CLOSE, body, body_len, 1, 1);
    c->discard = 0;
}
