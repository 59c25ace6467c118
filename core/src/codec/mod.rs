//! Backtrace codecs (lws `~m#`, Swift CBF, native compact format, interned stack store).
