/* Decode one rectangle of a JPEG with libjpeg-turbo, optionally at a reduced DCT scale.
 *
 * Python's image libraries decode whole images (or whole rows). libjpeg-turbo can do less:
 * jpeg_skip_scanlines entropy-decodes the rows above a region without the inverse DCT, upsampling
 * and colour conversion; jpeg_crop_scanline limits those to the region's columns; stopping after
 * the region's last row leaves the rest of the file unread. The pixels are those of a full decode
 * at the same scale (same DCT method and upsampling as a plain decode).
 *
 * Called from Python through ctypes (src/data/image_decode.py); built by scripts/setup_env.sh.
 */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#define API __attribute__((visibility("default")))

struct error_state {
    struct jpeg_error_mgr manager;
    jmp_buf escape;
    int truncated;
};

static void on_error(j_common_ptr cinfo) {
    longjmp(((struct error_state *)cinfo->err)->escape, 1);
}

/* Warnings about corrupt data are ignored, as Pillow ignores them; running out of data inside the
 * region is not: the region would be filled with gray. */
static void on_message(j_common_ptr cinfo, int level) {
    struct error_state *state = (struct error_state *)cinfo->err;
    if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) state->truncated = 1;
}

static void copy_message(j_common_ptr cinfo, char *message, int message_size) {
    char text[JMSG_LENGTH_MAX];
    (*cinfo->err->format_message)(cinfo, text);
    snprintf(message, (size_t)message_size, "%s", text);
}

/* Decodes rows [top, bottom) and at least columns [left, right) of the image scaled by
 * 1/scale_denom (1, 2, 4 or 8) into `out` as RGB, `out_capacity` bytes. On success returns 0 and
 * region = {first column, width} of what was decoded (columns start on an iMCU boundary, so the
 * region may begin left of `left` and end right of `right`); each row is width * 3 bytes.
 * On failure returns -1 with the reason in `message`. */
API int jpeg_crop_decode(const unsigned char *data, unsigned long size, int scale_denom,
                         int left, int top, int right, int bottom,
                         unsigned char *out, long out_capacity, int *region,
                         char *message, int message_size) {
    struct jpeg_decompress_struct cinfo;
    struct error_state state;
    memset(&state, 0, sizeof(state));
    cinfo.err = jpeg_std_error(&state.manager);
    state.manager.error_exit = on_error;
    state.manager.emit_message = on_message;
    if (setjmp(state.escape)) {
        copy_message((j_common_ptr)&cinfo, message, message_size);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale_denom;
    jpeg_start_decompress(&cinfo);

    if (left < 0 || top < 0 || right > (int)cinfo.output_width || bottom > (int)cinfo.output_height ||
        left >= right || top >= bottom) {
        snprintf(message, (size_t)message_size, "region %d,%d-%d,%d outside the %ux%u image", left, top,
                 right, bottom, cinfo.output_width, cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    JDIMENSION first_column = (JDIMENSION)left, width = (JDIMENSION)(right - left);
    jpeg_crop_scanline(&cinfo, &first_column, &width);
    long row_bytes = (long)width * cinfo.output_components;
    if (cinfo.output_components != 3 || row_bytes * (bottom - top) > out_capacity) {
        snprintf(message, (size_t)message_size, "output buffer too small for %u columns x %d rows",
                 width, bottom - top);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
    while (cinfo.output_scanline < (JDIMENSION)bottom) {
        JSAMPROW row = out + row_bytes * (long)(cinfo.output_scanline - (JDIMENSION)top);
        jpeg_read_scanlines(&cinfo, &row, 1);
        if (state.truncated) {
            snprintf(message, (size_t)message_size, "image file is truncated");
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
    }
    region[0] = (int)first_column;
    region[1] = (int)width;
    jpeg_destroy_decompress(&cinfo); /* the rows below the region are never read */
    return 0;
}
