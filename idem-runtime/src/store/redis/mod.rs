//! Redis store (single node and Cluster): being written (issue 3).
