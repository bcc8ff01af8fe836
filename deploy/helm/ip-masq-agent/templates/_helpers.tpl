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

{{/* The agent's capabilities: all dropped, the four it needs added (deploy/base says why). */}}
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
{{- end }}
