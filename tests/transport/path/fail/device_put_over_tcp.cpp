// Must NOT compile: a put from local device memory into a peer's host
// memory over TCP (the CPU would read device memory).
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/path.hpp>
#include <gdr/transport/tcp.hpp>

void put_from_device_over_tcp() { gdr::require_path<gdr::tcp::transport, gdr::op::put, gdr::Device, gdr::Host>(); }
