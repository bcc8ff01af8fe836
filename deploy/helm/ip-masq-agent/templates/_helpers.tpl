{{/* The agent's image: the repository at the given tag, by default the chart's appVersion. */}}
{{- define "ip-masq-agent.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Where the agent runs, and so where cleanup must run: a pod spec's scheduling fields. */}}
{{- define "ip-masq-agent.placement" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.seccompProfile }}
securityContext:
  seccompProfile:
    {{- toYaml . | nindent 4 }}
{{- end }}
{{- end }}

{{/* The agent's capabilities: all dropped, the four it needs added (deploy/base says why), and
SYS_RESOURCE with memlock (deploy/overlays/memlock says why). */}}
{{- define "ip-masq-agent.securityContext" -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsUser: 0
capabilities:
  drop: ["ALL"]
  add:
    - NET_ADMIN
    - BPF
    - PERFMON
    - NET_RAW
    {{- if .Values.memlock }}
    - SYS_RESOURCE
    {{- end }}
{{- end }}

{{/* Whether the agent talks to the API server (a non-empty string when it does): to read its
configuration, to write its node's status, or to check its scrapers (metrics.secure). */}}
{{- define "ip-masq-agent.api" -}}
{{- if or (ne .Values.configSource "file") .Values.nodeStatus.enabled .Values.metrics.secure }}true{{ end }}
{{- end }}

{{/* The objects of a file of deploy/, one document each, in the release's namespace where they
are namespaced: its ServiceAccount subjects and the ConfigMap policy's binding follow it. */}}
{{- define "ip-masq-agent.objects" -}}
{{- range $doc := splitList "\n---\n" (.root.Files.Get .file) }}
{{- $o := fromYaml $doc }}
{{- if $o.spec }}{{- with $o.spec.matchResources }}{{- with .namespaceSelector }}
{{- $_ := set .matchLabels "kubernetes.io/metadata.name" $.root.Release.Namespace }}
{{- end }}{{- end }}{{- end }}
{{- range $o.subjects }}{{- $_ := set . "namespace" $.root.Release.Namespace }}{{- end }}
{{- if has $o.kind (list "ServiceAccount" "Secret" "Role" "RoleBinding") }}{{- $_ := set $o.metadata "namespace" $.root.Release.Namespace }}{{- end }}
---
{{ toYaml $o }}
{{- end }}
{{- end }}
