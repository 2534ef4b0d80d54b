"""Weight-file formats read and written without the model layer: bytes in, arrays out."""
