"""The data wing: datasets and their splits (`datasets`), reading photos into pixels (`images`),
the Python API's kinds of input (`inputs`: paths, URLs, PIL images, arrays, bytes), downloading
http(s) URLs (`fetch`), the special token ids (`vocab`) and the tokenizers (`tokenizers`).

May import: `captionkit.core` only."""
