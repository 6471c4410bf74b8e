// Must NOT compile: TCP has no path for device memory yet (the staged rows
// come with staging). The error names the combination and what to do.
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/path.hpp>
#include <gdr/transport/tcp.hpp>

void send_device_over_tcp() { gdr::require_path<gdr::tcp::transport, gdr::op::send, gdr::Device>(); }
