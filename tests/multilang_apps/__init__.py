"""Small amazon_kclpy applications (v1, v2 and v3 interfaces) that the multilang tests run as
child processes, and the helper that fetches the amazon_kclpy package they import."""
