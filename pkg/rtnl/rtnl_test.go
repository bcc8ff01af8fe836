package rtnl

import "testing"

func TestSocketCarriesTimeout(t *testing.T) {
	s, err := Socket()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if send, recv := s.Socket.GetTimeouts(); send != Timeout || recv != Timeout {
		t.Errorf("timeouts: send %v, receive %v; want %v", send, recv, Timeout)
	}
}

// A handle answers a request: the loopback device is in every namespace.
func TestHandleAnswers(t *testing.T) {
	h, err := Handle()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if _, err := h.LinkByName("lo"); err != nil {
		t.Errorf("link lo: %v", err)
	}
}
