"""The ``captionkit`` command line: `main` assembles the parser from one module per command
group, each owning its subcommands' options next to their code; `argtypes` holds the option
types. Nothing else in captionkit imports this wing."""
