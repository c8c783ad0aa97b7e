"""``szconvert``: the command line of szformat (convert, decompress, info, verify)."""
