package markdown

import (
	"slices"
	"testing"
)

const page = "# Title\n\n## A\n\n| k | v |\n|---|---|\n| `a` | one \\| two |\n| `b` | three |\n\n" +
	"### A.1\n\ntext\n\n<!-- example: above -->\n```yaml\n## not a heading\nkey: 1\n```\n\n## B\n\nlast\n"

func TestSection(t *testing.T) {
	a, ok := Section(page, "## A")
	if !ok {
		t.Fatal("no section A")
	}
	if want := "\n| k | v |\n|---|---|\n| `a` | one \\| two |\n| `b` | three |\n\n### A.1\n\ntext\n\n" +
		"<!-- example: above -->\n```yaml\n## not a heading\nkey: 1\n```\n"; a != want {
		t.Errorf("section A:\n%q\nwant\n%q", a, want)
	}
	if b, ok := Section(page, "## B"); !ok || b != "\nlast\n" {
		t.Errorf("section B: %q, %v", b, ok)
	}
	if _, ok := Section(page, "## C"); ok {
		t.Error("section C found")
	}
	if got := Headings(page); !slices.Equal(got, []string{"# Title", "## A", "### A.1", "## B"}) {
		t.Errorf("headings %q", got)
	}
}

func TestRows(t *testing.T) {
	got := Rows(page)
	if len(got) != 2 || !slices.Equal(got[0], []string{"`a`", "one | two"}) || !slices.Equal(got[1], []string{"`b`", "three"}) {
		t.Errorf("rows %q", got)
	}
	if got := CodeSpans("`a` and `b c`, not d"); !slices.Equal(got, []string{"a", "b c"}) {
		t.Errorf("code spans %q", got)
	}
}

func TestBlocks(t *testing.T) {
	blocks, err := Blocks(page)
	if err != nil {
		t.Fatal(err)
	}
	if len(blocks) != 1 || blocks[0] != (Block{Line: 15, Lang: "yaml", Body: "## not a heading\nkey: 1", Example: "above"}) {
		t.Errorf("blocks %+v", blocks)
	}
	if _, err := Blocks("```\nopen"); err == nil {
		t.Error("an open block is no error")
	}
}

func TestAnchor(t *testing.T) {
	for heading, want := range map[string]string{
		"### Uplinks: every device pod traffic leaves by": "uplinks-every-device-pod-traffic-leaves-by",
		"## `dump`":                        "dump",
		"## Upgrade and rollback":          "upgrade-and-rollback",
		"## Closing needs a plausible FIN": "closing-needs-a-plausible-fin",
	} {
		if got := Anchor(heading); got != want {
			t.Errorf("Anchor(%q) = %q, want %q", heading, got, want)
		}
	}
}
