package bpf

// The clang flags come from the Makefile (BPF_CFLAGS), so that `make generate` is the one way to
// rebuild the objects; bpf/masq.c refuses to compile without them. The datapath's event names
// are enum event's (bpf/types.h), by stringer over the constants bpf2go writes for it.
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "$BPF_CFLAGS" -type nat_kind -type nat_flags -type nat_dir -type action -type rule_origin -type event masq ../../bpf/masq.c -- -I../../headers
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "$BPF_CFLAGS" -type slot_claim -type claim_args claim ../../bpf/claim.c -- -I../../headers
//go:generate go tool stringer -tags linux -type masqEvent -trimprefix masqEventEV_ -output event_string.go
