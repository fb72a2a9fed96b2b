"""The data wing: datasets and their splits (`datasets`), reading photos into pixels (`images`),
the special token ids (`vocab`) and the tokenizers (`tokenizers`).

May import: `captionkit.core` only."""
