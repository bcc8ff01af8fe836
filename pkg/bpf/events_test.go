package bpf

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
)

// docs/reference.md's table of datapath events lists every event of enum event, in its order,
// and nothing else.
func TestReferenceListsEveryEvent(t *testing.T) {
	doc, err := markdown.Read("docs/reference.md")
	if err != nil {
		t.Fatal(err)
	}
	section, ok := markdown.Section(doc, "## Datapath events")
	if !ok {
		t.Fatal("docs/reference.md has no Datapath events section")
	}
	var listed []string
	for _, cells := range markdown.Rows(section) {
		if strings.HasPrefix(cells[0], "`") {
			listed = append(listed, strings.Trim(cells[0], "`"))
		}
	}
	var want []string
	for _, e := range Events() {
		want = append(want, e.String())
	}
	if !slices.Equal(listed, want) {
		t.Errorf("docs/reference.md lists the events %q, the datapath counts %q", listed, want)
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
