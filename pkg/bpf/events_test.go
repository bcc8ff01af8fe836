package bpf

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
)

// The README's table of datapath events lists every event of enum event, in its order, and
// nothing else.
func TestREADMEListsEveryEvent(t *testing.T) {
	data, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(data), "\n### Datapath events\n")
	if !ok {
		t.Fatal("README has no Datapath events section")
	}
	section, _, _ = strings.Cut(section, "\n#")
	var listed []string
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 || !strings.HasPrefix(strings.TrimSpace(cells[1]), "`") {
			continue
		}
		listed = append(listed, strings.Trim(strings.TrimSpace(cells[1]), "`"))
	}
	var want []string
	for _, e := range Events() {
		want = append(want, e.String())
	}
	if !slices.Equal(listed, want) {
		t.Errorf("README lists the events %q, the datapath counts %q", listed, want)
	}
}

// Event names are enum event's enumerators without EV_, in lower case; the drops are EV_DROP_*.
func TestEventNames(t *testing.T) {
	if got := Event(masqEventEV_NEW_MASQ).String(); got != "new_masq" {
		t.Errorf("EV_NEW_MASQ is %q", got)
	}
	if got, want := Event(masqEventEV_MAX).String(), fmt.Sprintf("event_%d", numEvents); got != want {
		t.Errorf("EV_MAX is %q, want %q", got, want)
	}
	var drops []string
	for _, e := range Events() {
		if reason, ok := e.DropReason(); ok {
			drops = append(drops, reason)
		}
	}
	if want := []string{"no_port", "no_addr", "rewrite", "untranslatable"}; !slices.Equal(drops, want) {
		t.Errorf("drop reasons %q, want %q", drops, want)
	}
}
