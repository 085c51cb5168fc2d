"""The toy tooling, apart from the library: micro models built from config classes and synthetic shape renders
(`tiny`), the bundled tiny bases' builder (`tiny_base`), the shapes judge behind `difftune eval` (`judge`) and the
benchmark's model shapes (`bench`). The library reaches it only for `difftune eval` and `validation.eval_concept`;
it is how difftune is tested and measured with no downloads."""
