// Must NOT compile: a get from a peer's device memory over loopback (the
// owner's CPU would read device memory).
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/path.hpp>
#include <gdr/transport/tcp.hpp>

void get_from_peer_device() { gdr::require_path<gdr::loopback::transport, gdr::op::get, gdr::Pinned, gdr::Device>(); }
