// Compiles: the checker-check below must therefore go red.
#include <gdr/config.hpp>

int main() { return GDR_HAS_CUDA; }
