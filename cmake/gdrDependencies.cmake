# The system libraries behind gdr's components, as imported targets named
# gdr_deps::<name>. Included by gdr's own CMakeLists.txt and by the installed
# gdrConfig.cmake, so a build tree and an installed prefix find them the same
# way. Each gdr_find_<component>() sets gdr_<component>_deps_FOUND and, when
# something is missing, gdr_<component>_deps_MISSING (what, in words).
include_guard(GLOBAL)

# One system library and its header as gdr_deps::<name>.
function(_gdr_import name header library)
  if(TARGET gdr_deps::${name})
    return()
  endif()
  find_path(GDR_${name}_INCLUDE_DIR ${header})
  find_library(GDR_${name}_LIBRARY ${library})
  if(GDR_${name}_INCLUDE_DIR AND GDR_${name}_LIBRARY)
    add_library(gdr_deps::${name} UNKNOWN IMPORTED)
    set_target_properties(gdr_deps::${name} PROPERTIES
      IMPORTED_LOCATION "${GDR_${name}_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${GDR_${name}_INCLUDE_DIR}")
  endif()
endfunction()

macro(gdr_find_core)
  find_package(Threads QUIET)
  _gdr_import(uring liburing.h uring)
  if(TARGET gdr_deps::uring AND TARGET Threads::Threads)
    set(gdr_core_deps_FOUND TRUE)
  else()
    set(gdr_core_deps_FOUND FALSE)
    set(gdr_core_deps_MISSING "liburing (Debian: apt-get install liburing-dev)")
  endif()
endmacro()

macro(gdr_find_cuda)
  find_package(CUDAToolkit QUIET)
  if(TARGET CUDA::cudart)
    set(gdr_cuda_deps_FOUND TRUE)
  else()
    set(gdr_cuda_deps_FOUND FALSE)
    set(gdr_cuda_deps_MISSING "the CUDA toolkit (set CUDAToolkit_ROOT, e.g. /usr/local/cuda)")
  endif()
endmacro()

macro(gdr_find_verbs)
  _gdr_import(ibverbs infiniband/verbs.h ibverbs)
  _gdr_import(rdmacm rdma/rdma_cma.h rdmacm)
  if(TARGET gdr_deps::ibverbs AND TARGET gdr_deps::rdmacm)
    set(gdr_verbs_deps_FOUND TRUE)
  else()
    set(gdr_verbs_deps_FOUND FALSE)
    set(gdr_verbs_deps_MISSING "rdma-core's libibverbs and librdmacm (Debian: apt-get install libibverbs-dev librdmacm-dev)")
  endif()
endmacro()

macro(gdr_find_mpi)
  find_package(MPI QUIET COMPONENTS CXX)
  if(TARGET MPI::MPI_CXX)
    set(gdr_mpi_deps_FOUND TRUE)
  else()
    set(gdr_mpi_deps_FOUND FALSE)
    set(gdr_mpi_deps_MISSING "an MPI with C++ bindings (Debian: apt-get install libopenmpi-dev)")
  endif()
endmacro()
