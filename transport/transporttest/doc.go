// Package transporttest provides fakes for tests of code built on package
// transport: connected session pairs over an in-memory pipe or TCP loopback,
// without UCX, in one process.
//
// It must never be imported by non-test code.
package transporttest
