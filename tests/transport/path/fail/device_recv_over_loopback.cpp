// Must NOT compile: loopback cannot receive into device memory yet.
#include <gdr/transport/loopback.hpp>
#include <gdr/transport/path.hpp>
#include <gdr/transport/tcp.hpp>

void recv_into_device_over_loopback() { gdr::require_path<gdr::loopback::transport, gdr::op::recv, gdr::Device>(); }
