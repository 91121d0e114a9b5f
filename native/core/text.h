// Text the native library hands to Python: log lines and error messages quote what a model file
// holds (key names, token text), which need not be UTF-8; Python strings must be.
#pragma once

#include <string>
#include <string_view>

namespace retro {

// `text` with every byte that does not begin a well-formed UTF-8 sequence replaced by U+FFFD.
inline std::string valid_utf8(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    const auto * s = reinterpret_cast<const unsigned char *>(text.data());
    const size_t n = text.size();
    for (size_t i = 0; i < n;) {
        const unsigned char c = s[i];
        // the length of the sequence `c` starts and the range its second byte must fall in
        // (which rules out overlong forms, surrogates and code points past U+10FFFF)
        size_t len       = 0;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            len = 1;
        } else if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            lo  = c == 0xE0 ? 0xA0 : 0x80;
            hi  = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            lo  = c == 0xF0 ? 0x90 : 0x80;
            hi  = c == 0xF4 ? 0x8F : 0xBF;
        }
        bool ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; ++k) {
            ok = k == 1 ? s[i + 1] >= lo && s[i + 1] <= hi : (s[i + k] & 0xC0) == 0x80;
        }
        if (ok) {
            out.append(text.data() + i, len);
            i += len;
        } else {
            out += "\xEF\xBF\xBD";
            i += 1;
        }
    }
    return out;
}

}  // namespace retro
